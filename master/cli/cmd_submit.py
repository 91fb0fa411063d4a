"""`dlrover submit` and `dlrover master`: run a job from its YAML spec, locally (supervised),
on Ray or on Kubernetes; `master` is the same without the live display."""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import signal
import sys

from master.cli.cmd_brain import brain_location
from master.cli.exit_codes import EXIT_CODES_HELP, job_exit_code
from master.cli.ray_master_actor import run_master_actor
from master.cli.run_layout import STATE_FILE, RunLayout, run_layout
from master.config import NODE_TYPES, JobSpec, MasterConfig, SpecError, load_job_spec
from master.config.master_config import RPC_SERVERS
from master.job.faults import FaultAction, FaultSpecError, parse_fault
from master.platform.api import PlatformError
from master.platform.factory import PLATFORMS

# A supervised master child's exit when a port it was given is taken (the supervisor may retry).
PORT_TAKEN_EXIT = 75
# How many fresh port pairs the supervisor tries when a port it picked is taken before the
# master binds it (another process, e.g. Ray's, bound it in between).
PORT_PICKS = 3


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `submit` and `master` subcommands and their (mostly shared) flags."""
    for name, help_text in (
        ("submit", "run a job from its YAML spec (local processes by default), with live progress"),
        ("master", "run a job's master without the live display (for containers and scripts)"),
    ):
        s = sub.add_parser(name, help=help_text, description=help_text, epilog=EXIT_CODES_HELP)
        s.add_argument("job_yaml", help="the job spec (see README: 'The job YAML')")
        s.add_argument(
            "--platform", default="local", choices=PLATFORMS, help="where nodes run (default local)"
        )
        s.add_argument(
            "--ray-address",
            default="",
            help="with --platform ray: the cluster (default: start one)",
        )
        if name == "submit":
            s.add_argument(
                "--master-actor",
                action="store_true",
                help="with --platform ray --ray-address: run the master as a detached Ray actor "
                "that Ray restarts if it dies (the job goes on if this command ends)",
            )
        s.add_argument("--host", default="127.0.0.1", help="address the master listens on")
        s.add_argument("--port", type=int, default=0, help="master port (0: any free port)")
        s.add_argument(
            "--rpc-server",
            choices=RPC_SERVERS,
            default="aio",
            help="the master's gRPC server: aio (default: an event loop answers heartbeats, "
            "shard asks and progress reports) or sync (a thread per call and per stream)",
        )
        s.add_argument(
            "--brain",
            default="",
            metavar="LOCATION",
            help="job history to learn from and record to: a SQLite file, or the http:// URL of "
            "`dlrover brain serve`; 'off' for none (default: WORKDIR/runs/brain.sqlite)",
        )
        s.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="port of /metrics and the dashboard (default: the job's metrics_port; 0: any)",
        )
        s.add_argument("--run-dir", default="", help="logs, state and model dir of this run")
        s.add_argument("--summary-json", default="", help="write the job summary here at the end")
        s.add_argument(
            "--kill",
            action="append",
            default=[],
            metavar="TYPE:RANK@WHEN",
            help="fault injection: kill a node when WHEN is reached: 50%% (of all records), "
            "30s (after start) or step=1000; e.g. worker:1@50%%, or worker:1@50%%:SIGTERM; "
            "worker:1@50%%:freeze[=20s] freezes it instead (SIGSTOP). May repeat.",
        )
        s.add_argument("--status-interval", type=float, default=2.0, help="seconds between lines")
        s.add_argument(
            "--tls",
            action="store_true",
            help="serve gRPC over mutual TLS with certificates made for this job (<run dir>/tls)",
        )
        s.add_argument(
            "--state",
            default="",
            help="where the master keeps its state: a SQLite path "
            f"(default <run dir>/{STATE_FILE}), ':memory:' (no durability: a master that dies "
            "ends the job) or etcd://host:port[,host:port][/prefix]",
        )
        s.add_argument("--tls-cert", default="", help="the master's TLS certificate (PEM)")
        s.add_argument("--tls-key", default="", help="the master's TLS private key (PEM)")
        s.add_argument("--tls-ca", default="", help="the CA (PEM) nodes trust the master by")
        # Internal: set by the `dlrover submit` supervisor on the master it runs.
        s.add_argument("--lifeline-fd", type=int, default=-1, help=argparse.SUPPRESS)
        s.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
        # Set in the master's Kubernetes Job: resume when the state holds the job running.
        s.add_argument("--resume-if-started", action="store_true", help=argparse.SUPPRESS)
        s.add_argument("--job-token-file", default="", help=argparse.SUPPRESS)
        s.add_argument("--ray-namespace", default="", help=argparse.SUPPRESS)
        s.add_argument("-v", "--verbose", action="store_true", help="log the master's internals")
        if name == "submit":
            s.add_argument(
                "--dry-run",
                action="store_true",
                help="with --platform k8s: print the job's Kubernetes objects as YAML, create none",
            )
            s.add_argument(
                "--namespace", default="", help="with --platform k8s: namespace (default: default)"
            )
            s.add_argument(
                "--image",
                default="",
                help="with --platform k8s: image of the master and nodes "
                "(default: dlrover-elastic:latest)",
            )
            s.add_argument(
                "--data-claim",
                default="",
                metavar="PVC",
                help="with --platform k8s: PersistentVolumeClaim mounted at /var/dlrover in the "
                "master and every node (run dirs; the state unless --state is etcd://)",
            )


REMOVE = FaultAction.REMOVE_NODE


def _check_host_faults(args: argparse.Namespace, kills: list[str]) -> None:
    """A `--kill ...:node` (a Ray node removed) needs a Ray cluster of several Ray nodes."""
    if not kills:
        return
    if args.platform != "ray":
        raise FaultSpecError(
            f"--kill {kills[0]} removes the target's Ray node: it needs --platform ray "
            f"--ray-address ADDRESS (a Ray cluster of several Ray nodes), not --platform "
            f"{args.platform}; there, use a kill (drop :node) or :freeze"
        )
    if not args.ray_address:
        raise FaultSpecError(
            f"--kill {kills[0]} removes the target's Ray node: give --ray-address of a Ray "
            "cluster of several Ray nodes (the one `--platform ray` starts alone has a single "
            "node, the master's, which is never removed)"
        )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run `submit` or `master` as args say; argv (the whole command line) is passed on to the
    master that a supervisor or a Ray actor starts. Returns the exit code."""
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.cmd == "master" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        spec = load_job_spec(args.job_yaml)
        if args.metrics_port is not None:
            spec = spec.with_overrides(metrics_port=args.metrics_port)
        faults = tuple(parse_fault(k) for k in args.kill)
        _check_host_faults(
            args, [k for k, f in zip(args.kill, faults, strict=True) if f.action == REMOVE]
        )
        layout = run_layout(spec, args.run_dir, args.state, args.host)
        master_config = MasterConfig(
            host=args.host,
            port=args.port,
            rpc_server=args.rpc_server,
            tls_auto=args.tls,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            state_path=layout.state,
        )
    except (SpecError, FaultSpecError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "submit" and args.platform != "k8s":
        images = sorted({spec.group(t).image for t in NODE_TYPES if spec.group(t).image})
        if images and args.lifeline_fd < 0:  # said once, not again by the supervised master
            print(
                f"dlrover: note: on --platform {args.platform} each container's command runs as "
                f"a process here; the image{'s' if len(images) > 1 else ''} "
                f"({', '.join(images)}) and working director{'ies' if len(images) > 1 else 'y'} "
                "inside it are used on --platform k8s only",
                file=sys.stderr,
            )
        given = [f for f in ("dry_run", "namespace", "image", "data_claim") if getattr(args, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            print(f"dlrover: error: {flags} only apply with --platform k8s", file=sys.stderr)
            return 2
    if args.cmd == "submit" and args.platform == "k8s":
        # The master runs in the cluster (`dlrover master --platform k8s` in its pod).
        from master.cli.k8s_submit import submit_k8s
        from master.config.kubeflow import manifest_namespace

        return submit_k8s(
            spec,
            args.job_yaml,
            args.namespace or manifest_namespace(args.job_yaml),
            args.image,
            args.dry_run,
            state=args.state,
            data_claim=args.data_claim,
        )
    from master.cli.submit import SubmitOptions, run_job

    if args.cmd == "submit" and getattr(args, "master_actor", False):
        return run_master_actor(spec, args, argv, layout)
    if args.cmd == "submit" and args.lifeline_fd < 0 and _supervised(args):
        return _supervise(spec, args, argv, layout)
    resume = args.resume
    if args.resume_if_started or args.job_token_file:
        try:
            resume, ended, master_config = restartable_master(layout, args, master_config)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: StateStoreError
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        if ended:
            print(f"dlrover: the job already ended ({ended}); nothing to run", file=sys.stderr)
            return job_exit_code(ended)
    opts = SubmitOptions(
        master=master_config,
        run_dir=layout.run_dir,
        summary_json=args.summary_json,
        faults=faults,
        status_interval=args.status_interval,
        quiet=args.cmd == "master",
        platform=args.platform,
        platform_options=_platform_options(args),
        resume=resume,
        brain=brain_location(args.brain, spec),
    )
    from master.client.tls import TLSError

    # `kill -USR1 <master pid>`: every thread's stack on the master's stderr (where a hung
    # master waits), and the master goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return run_job(spec, opts)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"dlrover: error: {e.strerror}", file=sys.stderr)
            # Under the supervisor, which may have picked that port: it can pick another.
            return PORT_TAKEN_EXIT if args.lifeline_fd >= 0 else 2
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    except (PlatformError, TLSError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2


def _supervised(args: argparse.Namespace) -> bool:
    """Whether `dlrover submit` runs the master as a child it restarts: always locally; on Ray
    when the cluster outlives the master (--ray-address), so its node actors can too."""
    return args.platform == "local" or (args.platform == "ray" and bool(args.ray_address))


def restartable_master(
    layout: RunLayout, args: argparse.Namespace, cfg: MasterConfig
) -> tuple[bool, str, MasterConfig]:
    """(resume, ended state or "", config) of a master that may be a restarted one.

    --resume-if-started: resume when the state holds the job running; report its end when it
    holds it ended. --job-token-file: the token a previous master gave its nodes, if the file
    exists (a fresh job makes a new one).
    """
    import dataclasses
    import os

    from master.cli.submit import write_token
    from master.state.job_record import recorded_job_state

    resume, ended = args.resume, ""
    if args.resume_if_started:
        if not args.run_dir:
            raise ValueError("--resume-if-started needs --run-dir (the run to resume)")
        recorded = recorded_job_state(layout.state, layout.namespace)
        if recorded in ("succeeded", "failed", "stopped"):
            ended = recorded
        resume = recorded == "running"
    if args.job_token_file and os.path.exists(args.job_token_file):
        with open(args.job_token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if token:
            cfg = dataclasses.replace(cfg, job_token=token)
            if resume and not os.path.exists(layout.token_file):  # a new pod: run dir not kept
                os.makedirs(layout.run_dir, exist_ok=True)
                write_token(layout.token_file, token)
    return resume, ended, cfg


def _platform_options(args: argparse.Namespace) -> dict[str, str]:
    if args.platform == "ray":
        return {"address": args.ray_address, "namespace": args.ray_namespace}
    if args.platform == "local" and args.lifeline_fd >= 0:
        return {"lifeline_fd": str(args.lifeline_fd)}
    return {}


def _supervise(spec: JobSpec, args: argparse.Namespace, argv: list[str], layout: RunLayout) -> int:
    """Run the master as a supervised child that is restarted, with its nodes kept, if it dies."""
    from master.cli.supervisor import MasterSupervisor

    anchor = None
    extra: list[str] = []
    if args.platform == "ray":
        # Node actors are created through an anchor this process holds: they outlive a
        # master that dies, and end with this process (see master/platform/ray/job_anchor.py).
        from master.platform.ray.job_anchor import start_job_anchor

        try:
            anchor = start_job_anchor(args.ray_address, layout.ray_namespace)
        except PlatformError as e:
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        extra += ["--ray-namespace", layout.ray_namespace]
    try:
        for pick in range(PORT_PICKS):
            # Picked here, so every restart of the master listens where its nodes dial (the
            # metrics port: the dashboard URL too).
            picked = layout.with_ports(args.port, spec.metrics_port)
            # Later options win in argparse: the child and every restart share these.
            child = [sys.executable, "-m", "master.cli", *argv, *picked.master_flags(), *extra]
            supervisor = MasterSupervisor(
                child, layout.run_dir, sys.stdout, state=layout.state, job=layout.namespace
            )
            code = supervisor.run()
            picked_here = not args.port or not spec.metrics_port
            if code != PORT_TAKEN_EXIT or not picked_here or pick == PORT_PICKS - 1:
                return 2 if code == PORT_TAKEN_EXIT else code
            print("dlrover: a port picked for the master was taken meanwhile; picking again")
        return 2
    finally:
        if anchor is not None:
            import ray

            ray.shutdown()  # the anchor, and every node actor it owns, end with this driver
