"""`dlrover brain serve` and `dlrover brain propose`: the job-history Brain."""

from __future__ import annotations

import argparse
import logging
import sys

from master.config import JobSpec, SpecError, load_job_spec


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `brain` subcommand with its `serve` and `propose` subcommands."""
    br = sub.add_parser("brain", help="the job-history Brain: serve it, or ask it about a job")
    br_sub = br.add_subparsers(dest="brain_cmd", required=True)
    serve = br_sub.add_parser("serve", help="serve the Brain over HTTP for many masters")
    serve.add_argument(
        "--db",
        required=True,
        metavar="LOCATION",
        help="its history: a SQLite file, or a postgresql:// URL",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    ask = br_sub.add_parser("propose", help="what the Brain proposes for the next run of a job")
    ask.add_argument("job_yaml", help="the job spec")
    ask.add_argument(
        "--brain", default="", metavar="LOCATION", help="as for submit (default: the workdir's)"
    )


def brain_location(given: str, spec: JobSpec) -> str:
    """Where the Brain is: the --brain flag, or the job's default (in its workdir)."""
    from master.brain.client import default_location

    return given or default_location(spec)


def run(args: argparse.Namespace) -> int:
    """`dlrover brain serve` and `dlrover brain propose`."""
    import json

    from master.brain.client import Brain, BrainError, open_history

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.brain_cmd == "serve":
            from master.brain.service import BrainService

            service = BrainService(open_history(args.db), args.host, args.port)
            print(f"brain serving {args.db} at http://{args.host}:{service.port}", flush=True)
            try:
                service.serve_forever()
            except KeyboardInterrupt:
                pass
            return 0
        spec = load_job_spec(args.job_yaml)
        brain = Brain(brain_location(args.brain, spec))
        try:
            print(json.dumps(brain.propose(spec).to_dict(), indent=2))
        finally:
            brain.close()
        return 0
    except (SpecError, BrainError, ValueError, OSError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
