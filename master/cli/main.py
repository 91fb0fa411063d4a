"""The `dlrover` command: submit a job, run a master, or show a running job's status."""

from __future__ import annotations

import argparse
import logging
import sys

from master.config import MasterConfig, SpecError, load_job_spec
from master.job.faults import FaultSpecError, parse_fault
from master.platform.api import PlatformError
from master.platform.factory import PLATFORMS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrover", description="Elastic distributed training master")
    sub = p.add_subparsers(dest="cmd", required=True)

    for name, help_text in (
        ("submit", "run a job from its YAML spec (local processes by default), with live progress"),
        ("master", "run a job's master without the live display (for containers and scripts)"),
    ):
        s = sub.add_parser(name, help=help_text)
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
            "30s (after start) or step=1000; e.g. worker:1@50%%. May repeat.",
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
            help="where the master keeps its state: a SQLite path (default <run dir>/state.sqlite) "
            "or etcd://host:port[,host:port][/prefix]",
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
    st = sub.add_parser("status", help="print the status of a running job (--watch: live view)")
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until the job ends",
    )
    st.add_argument(
        "--show-dashboard-token",
        action="store_true",
        help="print the dashboard link with its login token (read from .dashboard_token next to "
        "--token-file); anyone with the link can read the dashboard",
    )
    sc = sub.add_parser(
        "scale", help="change the number of workers, evaluators or PS of a running job"
    )
    sc.add_argument(
        "target",
        metavar="TYPE=N",
        help="e.g. worker=3; ps=2 checkpoints, then restarts PS, chief and workers on 2 PS",
    )
    sc.add_argument("--reason", default="", help="shown in the job's events")
    ch = sub.add_parser(
        "chaos", help="run a job while killing random nodes and its master; report what it took"
    )
    ch.add_argument("job_yaml", help="the job spec")
    ch.add_argument("--kills", type=int, default=10, help="how many kills (default 10)")
    ch.add_argument("--seed", type=int, default=0, help="picks the targets (default 0)")
    ch.add_argument(
        "--baseline", action="store_true", help="first run without faults, to measure time lost"
    )
    ch.add_argument("--out-dir", default="", help="run dirs go here (default: runs/chaos-TIME)")
    ch.add_argument("--report", default="", help="write the report as JSON here too")
    lg = sub.add_parser("logs", help="print a node's log, every incarnation in order")
    lg.add_argument("node", metavar="TYPE-RANK", help="e.g. worker-1")
    lg.add_argument("--run-dir", required=True, help="the job's run dir (printed at start)")
    lg.add_argument("--tail", type=int, default=0, help="only the last N lines of each")
    mg = sub.add_parser(
        "migrate", help="move a PS to new CPU or memory while the job trains (same address)"
    )
    mg.add_argument("node", metavar="TYPE-RANK", help="e.g. ps-0")
    mg.add_argument("--memory-mb", type=int, default=0, help="the new memory limit")
    mg.add_argument("--cpu", type=float, default=0.0, help="the new CPU count")
    mg.add_argument("--reason", default="", help="shown in the job's events")
    for cmd in (st, sc, mg):
        cmd.add_argument("--addr", required=True, help="master host:port")
        cmd.add_argument("--token-file", required=True, help="the run's .job_token file")
        cmd.add_argument("--ca-file", default="", help="TLS: the CA of a master run with --tls")
        cmd.add_argument("--client-cert", default="", help="mutual TLS: this client's cert")
        cmd.add_argument("--client-key", default="", help="mutual TLS: this client's key")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "scale":
        return _scale(args)
    if args.cmd == "migrate":
        return _migrate(args)
    if args.cmd == "logs":
        return _logs(args)
    if args.cmd == "chaos":
        return _chaos(args, argv)
    if args.cmd == "brain":
        return _brain(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.cmd == "master" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        spec = load_job_spec(args.job_yaml)
        if args.metrics_port is not None:
            spec = spec.with_overrides(metrics_port=args.metrics_port)
        faults = tuple(parse_fault(k) for k in args.kill)
        master_config = MasterConfig(
            host=args.host,
            port=args.port,
            tls_auto=args.tls,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            **({"state_path": args.state} if args.state else {}),
        )
    except (SpecError, FaultSpecError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "submit" and args.platform != "k8s":
        given = [f for f in ("dry_run", "namespace", "image", "data_claim") if getattr(args, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            print(f"dlrover: error: {flags} only apply with --platform k8s", file=sys.stderr)
            return 2
    if args.cmd == "submit" and args.platform == "k8s":
        # The master runs in the cluster (`dlrover master --platform k8s` in its pod).
        from master.cli.k8s_submit import submit_k8s

        return submit_k8s(
            spec,
            args.job_yaml,
            args.namespace,
            args.image,
            args.dry_run,
            state=args.state,
            data_claim=args.data_claim,
        )
    from master.cli.submit import SubmitOptions, run_job

    if args.cmd == "submit" and getattr(args, "master_actor", False):
        return _ray_master_actor(spec, args, argv)
    if args.cmd == "submit" and args.lifeline_fd < 0 and _supervised(args):
        return _supervise(spec, args, argv)
    resume = args.resume
    if args.resume_if_started or args.job_token_file:
        try:
            resume, ended, master_config = _restartable_master(spec, args, master_config)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: StateStoreError
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        if ended:
            print(f"dlrover: the job already ended ({ended}); nothing to run", file=sys.stderr)
            return 0 if ended == "succeeded" else 1
    opts = SubmitOptions(
        master=master_config,
        run_dir=args.run_dir,
        summary_json=args.summary_json,
        faults=faults,
        status_interval=args.status_interval,
        quiet=args.cmd == "master",
        platform=args.platform,
        platform_options=_platform_options(args),
        resume=resume,
        brain=_brain_location(args.brain, spec),
    )
    from master.client.tls import TLSError

    try:
        return run_job(spec, opts)
    except (OSError, PlatformError, TLSError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2


def _supervised(args: argparse.Namespace) -> bool:
    """Whether `dlrover submit` runs the master as a child it restarts: always locally; on Ray
    when the cluster outlives the master (--ray-address), so its node actors can too."""
    return args.platform == "local" or (args.platform == "ray" and bool(args.ray_address))


def _restartable_master(spec, args: argparse.Namespace, cfg: MasterConfig):
    """(resume, ended state or "", config) of a master that may be a restarted one.

    --resume-if-started: resume when the state holds the job running; report its end when it
    holds it ended. --job-token-file: the token a previous master gave its nodes, if the file
    exists (a fresh job makes a new one).
    """
    import dataclasses
    import os

    from master.cli.submit import TOKEN_FILE, state_namespace
    from master.state.job_record import recorded_job_state

    resume, ended = args.resume, ""
    if args.resume_if_started:
        if not args.run_dir:
            raise ValueError("--resume-if-started needs --run-dir (the run to resume)")
        state = args.state or os.path.join(os.path.abspath(args.run_dir), "state.sqlite")
        recorded = recorded_job_state(state, state_namespace(spec, os.path.abspath(args.run_dir)))
        if recorded in ("succeeded", "failed", "stopped"):
            ended = recorded
        resume = recorded == "running"
    if args.job_token_file and os.path.exists(args.job_token_file):
        with open(args.job_token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if token:
            cfg = dataclasses.replace(cfg, job_token=token)
            kept = os.path.join(os.path.abspath(args.run_dir or "."), TOKEN_FILE)
            if resume and not os.path.exists(kept):  # a new pod: its run dir was not kept
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(token)
    return resume, ended, cfg


def _platform_options(args: argparse.Namespace) -> dict[str, str]:
    if args.platform == "ray":
        return {"address": args.ray_address, "namespace": args.ray_namespace}
    if args.platform == "local" and args.lifeline_fd >= 0:
        return {"lifeline_fd": str(args.lifeline_fd)}
    return {}


def _supervise(spec, args: argparse.Namespace, argv: list[str]) -> int:
    """Run the master as a supervised child that is restarted, with its nodes kept, if it dies."""
    import os

    from master.cli.submit import default_run_dir, state_namespace
    from master.cli.supervisor import MasterSupervisor
    from master.platform.local import free_port

    run_dir = os.path.abspath(args.run_dir or default_run_dir(spec))
    host = args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"
    port = args.port or free_port(host)
    metrics_port = spec.metrics_port or free_port(host)  # the dashboard URL survives restarts
    # Later options win in argparse: the child and every restart share this run dir and ports.
    child = [sys.executable, "-m", "master.cli", *argv, "--run-dir", run_dir, "--port", str(port)]
    child += ["--metrics-port", str(metrics_port)]
    state = args.state or os.path.join(run_dir, "state.sqlite")
    namespace = state_namespace(spec, run_dir)
    anchor = None
    if args.platform == "ray":
        # Node actors are created through an anchor this process holds: they outlive a
        # master that dies, and end with this process (see master/platform/ray_platform.py).
        from master.platform.ray.job_anchor import start_job_anchor

        ray_namespace = "dlrover-" + namespace.replace("/", "-")
        try:
            anchor = start_job_anchor(args.ray_address, ray_namespace)
        except PlatformError as e:
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        child += ["--ray-namespace", ray_namespace]
    try:
        return MasterSupervisor(child, run_dir, sys.stdout, state=state, job=namespace).run()
    finally:
        if anchor is not None:
            import ray

            ray.shutdown()  # the anchor, and every node actor it owns, end with this driver


def _ray_master_actor(spec, args: argparse.Namespace, argv: list[str]) -> int:
    """`submit --platform ray --master-actor`: the master runs in a detached Ray actor that Ray
    restarts (master/platform/ray_platform.py, MasterActor); this command follows the job."""
    import os
    import time

    from master.cli.submit import default_run_dir, state_namespace
    from master.cli.supervisor import DEFAULT_MAX_MASTER_RESTARTS
    from master.platform.local import free_port
    from master.platform.ray.master_actor import MASTER_ACTOR_NAME, start_master_actor

    if args.platform != "ray" or not args.ray_address:
        print(
            "dlrover: error: --master-actor needs --platform ray and --ray-address (a cluster "
            "that outlives this command)",
            file=sys.stderr,
        )
        return 2
    run_dir = os.path.abspath(args.run_dir or default_run_dir(spec))
    os.makedirs(run_dir, exist_ok=True)
    host = args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"
    port = args.port or free_port(host)
    metrics_port = spec.metrics_port or free_port(host)
    namespace = state_namespace(spec, run_dir)
    ray_namespace = "dlrover-" + namespace.replace("/", "-")
    state = args.state or os.path.join(run_dir, "state.sqlite")
    rest = [a for a in argv[1:] if a != "--master-actor"]
    rest[rest.index(args.job_yaml)] = os.path.abspath(args.job_yaml)
    child = [*rest, "--run-dir", run_dir, "--port", str(port), "--metrics-port", str(metrics_port)]
    child += ["--ray-namespace", ray_namespace, "--resume-if-started"]
    if args.summary_json:
        child += ["--summary-json", os.path.abspath(args.summary_json)]
    log_path = os.path.join(run_dir, "master.log")
    try:
        actor = start_master_actor(
            args.ray_address,
            ray_namespace,
            child,
            state,
            namespace,
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
        f"{ray_namespace}) at {host}:{port}, run dir {run_dir}\n"
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


def _brain_location(given: str, spec) -> str:
    from master.brain.client import default_location

    return given or default_location(spec)


def _brain(args: argparse.Namespace) -> int:
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
        brain = Brain(_brain_location(args.brain, spec))
        try:
            print(json.dumps(brain.propose(spec).to_dict(), indent=2))
        finally:
            brain.close()
        return 0
    except (SpecError, BrainError, ValueError, OSError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2


def _chaos(args: argparse.Namespace, argv: list[str]) -> int:
    import os
    import time

    from master.cli.chaos import format_report, plan_kills, run_chaos, write_report

    try:
        spec = load_job_spec(args.job_yaml)
        plan = plan_kills(spec, args.kills, args.seed)
    except (SpecError, ValueError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(
        spec.workdir, "runs", f"chaos-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    print(f"== chaos plan (seed {plan.seed}): {', '.join(plan.kills)}")
    for warning in plan.warnings:
        print(f"   warning: {warning}")
    sys.stdout.flush()
    try:
        report = run_chaos(args.job_yaml, spec, plan, out_dir, args.baseline, sys.stdout)
    except RuntimeError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    report.command = "dlrover " + " ".join(argv)
    print(format_report(report))
    if args.report:
        write_report(report, args.report)
    ok = report.status == "succeeded" and report.records_missing == 0
    return 0 if ok else 1


def _admin_client(args: argparse.Namespace):
    from master.client import MasterClient, read_token
    from master.client.tls import ClientTLS

    token = read_token({"DLROVER_JOB_TOKEN_FILE": args.token_file})
    tls = ClientTLS(args.ca_file, args.client_cert, args.client_key) if args.ca_file else None
    return MasterClient(args.addr, token, retry_seconds=2.0, call_timeout=30.0, tls=tls)


def _scale(args: argparse.Namespace) -> int:
    from master.client import MasterError

    node_type, _, count = args.target.partition("=")
    if not count.isdigit():
        print(f"dlrover: error: {args.target!r}: expected TYPE=N, e.g. worker=3", file=sys.stderr)
        return 2
    try:
        reply = _admin_client(args).scale(node_type, int(count), args.reason)
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    version = reply.cluster_version
    print(f"{node_type}: {reply.previous} -> {reply.replicas} (cluster version {version})")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from master.client import MasterError

    node_type, _, rank = args.node.rpartition("-")
    if not node_type or not rank.isdigit():
        print(f"dlrover: error: {args.node!r}: expected TYPE-RANK, e.g. ps-0", file=sys.stderr)
        return 2
    try:
        reply = _admin_client(args).migrate(
            node_type, int(rank), args.memory_mb, args.cpu, args.reason
        )
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.node} moved: now id {reply.node_id}, restoring the checkpoint of step "
        f"{reply.checkpoint_step}"
    )
    return 0


def _logs(args: argparse.Namespace) -> int:
    import glob
    import os

    pattern = os.path.join(args.run_dir, "logs", f"{args.node}.*.log")
    paths = sorted(glob.glob(pattern), key=lambda p: int(p.rsplit(".", 2)[-2]))
    if not paths:
        known = sorted(
            {
                os.path.basename(p).split(".")[0]
                for p in glob.glob(os.path.join(args.run_dir, "logs", "*.log"))
            }
        )
        print(
            f"dlrover: error: no log of {args.node!r} in {args.run_dir}/logs "
            f"(nodes with logs: {', '.join(known) or 'none'})",
            file=sys.stderr,
        )
        return 2
    for path in paths:
        node_id = path.rsplit(".", 2)[-2]
        print(f"===== {args.node} id {node_id} ({path}) =====")
        with open(path, errors="replace") as f:
            lines = f.readlines()
        sys.stdout.writelines(lines[-args.tail :] if args.tail > 0 else lines)
    return 0


def _status(args: argparse.Namespace) -> int:
    import os

    from master.client import MasterError
    from master.observability.dashboard.auth import TOKEN_FILE, read_token
    from master.observability.status_view import DashboardAccess, show_status

    token_file = os.path.join(os.path.dirname(os.path.abspath(args.token_file)), TOKEN_FILE)
    try:
        token = read_token(token_file)
    except ValueError as e:
        if args.show_dashboard_token:
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        token = ""  # the screen then comes from the gRPC status alone
    access = DashboardAccess(token, token_file, args.ca_file, args.show_dashboard_token)
    try:
        client = _admin_client(args)
    except MasterError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    return show_status(client, args.watch, sys.stdout, access)


if __name__ == "__main__":
    sys.exit(main())
