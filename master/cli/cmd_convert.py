"""`dlrover convert FILE`: print the job YAML equivalent to a Kubeflow TFJob or PyTorchJob."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from master.config import SpecError, load_job_spec
from master.config.job_yaml import job_spec_document


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `convert` subcommand."""
    s = sub.add_parser(
        "convert",
        help="print the dlrover job YAML equivalent to a Kubeflow TFJob or PyTorchJob manifest",
    )
    s.add_argument("manifest", help="a kubeflow.org/v1 TFJob or PyTorchJob (or a job YAML)")


def run(args: argparse.Namespace) -> int:
    """Print the equivalent job YAML; 2 with one clear message if the manifest is refused."""
    try:
        spec = load_job_spec(args.manifest)
    except SpecError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    base_dir = os.path.dirname(os.path.abspath(args.manifest))
    doc = job_spec_document(spec, base_dir)
    print(f"# dlrover job YAML converted from {args.manifest} (save it beside the manifest)")
    print(yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100), end="")
    return 0
