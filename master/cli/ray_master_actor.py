"""`dlrover submit --platform ray --master-actor`: the master in a detached Ray actor, followed by
this command until the job ends."""

from __future__ import annotations

import argparse
import sys

from master.cli.run_layout import RunLayout
from master.config import JobSpec
from master.platform.api import PlatformError


def run_master_actor(
    spec: JobSpec, args: argparse.Namespace, argv: list[str], layout: RunLayout
) -> int:
    """`submit --platform ray --master-actor`: the master runs in a detached Ray actor that Ray
    restarts (master/platform/ray/master_actor.py); this command follows the job."""
    import os
    import time

    from master.cli.supervisor import DEFAULT_MAX_MASTER_RESTARTS
    from master.platform.ray.master_actor import MASTER_ACTOR_NAME, start_master_actor

    if args.platform != "ray" or not args.ray_address:
        print(
            "dlrover: error: --master-actor needs --platform ray and --ray-address (a cluster "
            "that outlives this command)",
            file=sys.stderr,
        )
        return 2
    os.makedirs(layout.run_dir, exist_ok=True)
    layout = layout.with_ports(args.port, spec.metrics_port)
    ray_namespace = layout.ray_namespace
    rest = [a for a in argv[1:] if a != "--master-actor"]
    rest[rest.index(args.job_yaml)] = os.path.abspath(args.job_yaml)
    child = [*rest, *layout.master_flags()]
    child += ["--ray-namespace", ray_namespace, "--resume-if-started"]
    if args.summary_json:
        child += ["--summary-json", os.path.abspath(args.summary_json)]
    log_path = layout.master_log
    try:
        actor = start_master_actor(
            args.ray_address,
            ray_namespace,
            child,
            layout.state,
            layout.namespace,
            log_path,
            DEFAULT_MAX_MASTER_RESTARTS,
        )
    except PlatformError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray.exceptions import RayActorError

    print(
        f"== job {spec.name}: master in Ray actor {MASTER_ACTOR_NAME!r} (namespace "
        f"{ray_namespace}) at {layout.host}:{layout.port}, run dir {layout.run_dir}\n"
        f"   log {log_path}; Ray restarts the master up to {DEFAULT_MAX_MASTER_RESTARTS} times; "
        "Ctrl-C stops the job",
        flush=True,
    )
    deaths = 0
    try:
        while True:
            try:
                code = ray.get(actor.wait.remote(5.0), timeout=120)
            except RayActorError as e:
                deaths += 1
                if deaths > DEFAULT_MAX_MASTER_RESTARTS + 1:
                    print(f"!! the master actor is gone for good: {e}", flush=True)
                    return 1
                print("!! master actor died; Ray restarts it, nodes keep running", flush=True)
                time.sleep(1.0)
                continue
            if code is not None:
                print(f"== job ended (master exit code {code}); log {log_path}", flush=True)
                ray.kill(actor, no_restart=True)
                return code
    except KeyboardInterrupt:
        ray.get(actor.stop.remote(), timeout=30)
        code = ray.get(actor.wait.remote(60.0), timeout=120)
        if code is not None:
            ray.kill(actor, no_restart=True)
        return 1 if code is None else code
    finally:
        ray.shutdown()
