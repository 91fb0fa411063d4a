"""Run a job end to end: master, platform, live progress, and the final summary."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TextIO

from master.brain.client import consult as consult_brain
from master.brain.client import report as report_to_brain
from master.cli.exit_codes import job_exit_code
from master.cli.run_layout import RunLayout, run_layout
from master.client import ENV_JOB_TOKEN_FILE, read_token
from master.client.tls import ClientTLS, ServerTLS, make_job_certificates
from master.config import JobSpec, MasterConfig
from master.job.autoscaler import brain_hint
from master.job.events import INCIDENT_KINDS, ROUTINE_KINDS
from master.job.faults import Fault
from master.job.master import LAUNCH_ORDER, JobEvent, JobMaster, JobRuntime, JobState
from master.nodes.model import ExitReason, Node
from master.nodes.policy import heartbeat_interval
from master.observability.endpoint import Observability
from master.platform.factory import create_platform
from master.rpc.aio_server import start_aio_server
from master.rpc.server import advertised_host, job_status_pb, start_server
from master.rpc.serving_gc import serving_gc
from master.state.api import StateStore
from master.state.factory import in_memory, open_state_store

log = logging.getLogger(__name__)

STATE_SHORT = {
    "pending": "pend",
    "running": "run",
    "succeeded": "ok",
    "failed": "FAIL",
    "deleted": "stop",
}


@dataclass(frozen=True)
class SubmitOptions:
    """How to run a job, from the command line."""

    master: MasterConfig = field(default_factory=MasterConfig)
    run_dir: str = ""
    summary_json: str = ""
    faults: tuple[Fault, ...] = ()
    status_interval: float = 2.0
    quiet: bool = False
    platform: str = "local"
    platform_options: Mapping[str, str] = field(default_factory=dict)
    resume: bool = False  # continue the job recorded in run_dir (a restarted master)
    brain: str = ""  # job history: a SQLite path or a Brain service URL; "" or "off": none


def write_token(path: str, token: str) -> str:
    """Write the job token to a file only the owner can read; nodes get the file's path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


class ProgressPrinter:
    """Prints job events as they happen and a progress line every few seconds."""

    def __init__(self, out: TextIO, interval: float) -> None:
        self.out = out
        self.interval = interval
        self.job: JobMaster | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._lock = threading.Lock()

    def start(self, job: JobMaster) -> None:
        self.job = job
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def event(self, ev: JobEvent) -> None:
        if ev.kind in ROUTINE_KINDS:
            return
        marker = "!!" if ev.kind in INCIDENT_KINDS else "=>"
        self._print(f"{marker} [{self._elapsed():6.1f}s] {ev.message}")

    def _elapsed(self) -> float:
        return self.job.elapsed() if self.job else 0.0

    def _print(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _loop(self) -> None:
        hinted = False
        while not self._stop.wait(self.interval):
            if self.job is not None and not self.job.state.ended:
                if not reports_progress(self.job):
                    if not hinted and self.job.elapsed() >= HINT_AFTER_SECONDS:
                        self._print(NO_REPORTS_HINT)
                        hinted = True
                    self._print(activity_line(self.job))
                else:
                    self._print(progress_line(self.job))


# Said once by the live display of a program that has reported nothing to the master this
# long (programs with our hooks report once TF has started).
HINT_AFTER_SECONDS = 20.0
# What it says: why the display shows node states and CPU, and how to get step reports.
NO_REPORTS_HINT = (
    "   (this program reports no steps to the master, so the display shows each node's state "
    "and CPU use;\n    for steps and data progress use dlrover_tf's hooks (estimator) or its "
    "Keras callback: README, 'Bring your TFJob / torchrun program')"
)


def reports_progress(job: JobMaster) -> bool:
    """Whether the job's program reports to the master (steps, datasets, heartbeats)."""
    return bool(
        job.global_step
        or job.sharding.stats()
        or any(n.registered for n in job.nodes.all_current())
    )


def activity_line(job: JobMaster) -> str:
    """The live line of a program without our hooks: elapsed time, each node's state and CPU
    use (where measured), and the stuck note if the job looks stuck."""
    nodes = sorted(job.nodes.all_current(), key=lambda n: (LAUNCH_ORDER.index(n.type), n.rank))
    parts = [f"   [{job.elapsed():6.1f}s] no step reports"]
    parts.append(
        " ".join(
            f"{n.name}:{STATE_SHORT.get(n.state.value, n.state.value)}"
            + (f"(r{n.relaunches})" if n.relaunches else "")
            + (f" {n.cpu_percent:.0f}%cpu" if n.state.value == "running" else "")
            for n in nodes
        )
    )
    if job.stuck_note:
        parts.append(job.stuck_note)
    return " | ".join(parts)


def progress_line(job: JobMaster) -> str:
    """One line: elapsed time, global step, data progress per dataset, node states."""
    status = job_status_pb(job)
    parts = [f"   [{status.elapsed_seconds:6.1f}s] step {status.global_step}"]
    for d in status.datasets:
        total = d.size * d.epochs
        done_in_epoch = max(0, d.records_done - d.current_epoch * d.size)
        parts.append(
            f"{d.name}: epoch {d.current_epoch + 1}/{d.epochs} "
            f"{min(done_in_epoch, d.size):,}/{d.size:,} "
            f"({100.0 * d.records_done / total if total else 0:.0f}% of all)"
        )
    current = {(n.type, n.rank): n for n in status.nodes}
    nodes = " ".join(
        f"{t}-{r}:{STATE_SHORT.get(n.status, n.status)}"
        + (f"(r{n.relaunches})" if n.relaunches else "")
        for (t, r), n in sorted(
            current.items(), key=lambda kv: (LAUNCH_ORDER.index(kv[0][0]), kv[0][1])
        )
    )
    parts.append(nodes)
    return " | ".join(parts)


def build_summary(job: JobMaster) -> dict:
    """The --summary-json document."""
    stats = job.sharding.stats()
    return {
        # How the job ended; a run cut short with the job still going counts as failed.
        "status": job.state.value if job.state.ended else JobState.FAILED.value,
        "reason": job.reason,
        "global_step": job.global_step,
        "datasets": {
            s.name: {
                "size": s.size,
                "epochs": s.epochs,
                "records_done": s.records_done,
                "records_redone": s.records_redone,
            }
            for s in stats
        },
        "nodes": [
            {
                "type": n.type,
                "rank": n.rank,
                "id": n.id,
                "status": n.state.value,
                "exit_reason": n.exit_reason.value,
                "relaunches": n.relaunches,
                **_diagnosis_fields(n),
            }
            for n in job.nodes.history()
        ],
        "events": [e.to_dict() for e in job.events],
        "run_dir": job.runtime.run_dir,
        "dashboard_url": job.runtime.dashboard_url,
        "wall_seconds": round(job.wall_seconds, 3),
    }


def _diagnosis_fields(node: Node) -> dict:
    """A failed node's classified cause and the log excerpt showing it; for a node the master
    stopped, why ("stopped: job done")."""
    cause = node.stop_cause
    if cause and node.exit_reason == ExitReason.STOPPED:
        return {"note": f"stopped: {cause}"}
    diagnosis = node.diagnosis
    if diagnosis is None or node.state.value != "failed":
        return {}
    return {"diagnosis": diagnosis.summary, "excerpt": diagnosis.excerpt}


def print_summary(summary: dict, out: TextIO) -> None:
    w = out.write
    w(f"\n== job {summary['status']} in {summary['wall_seconds']:.1f}s: {summary['reason']}\n")
    w(f"   global step: {summary['global_step']}\n")
    for name, d in summary["datasets"].items():
        total = d["size"] * d["epochs"]
        missing = total - d["records_done"]
        lost = "no record lost" if missing == 0 else f"{missing:,} records NOT done"
        w(
            f"   dataset {name}: {d['records_done']:,}/{total:,} records done "
            f"({d['epochs']} epoch(s) of {d['size']:,}); {d['records_redone']:,} handed out "
            f"again (their node ended before consuming them); {lost}\n"
        )
    relaunched = [n for n in summary["nodes"] if n["relaunches"]]
    failed = [n for n in summary["nodes"] if n["status"] == "failed"]
    w(f"   nodes: {len(summary['nodes'])} incarnations, {len(relaunched)} relaunches\n")
    for n in failed:
        w(f"     {n['type']}-{n['rank']} id {n['id']}: failed ({n['exit_reason']})\n")
    for n in relaunched:
        name = f"{n['type']}-{n['rank']} id {n['id']}"
        w(f"     {name}: relaunch #{n['relaunches']}, {n['status']}\n")
    w(f"   logs: {os.path.join(summary['run_dir'], 'logs')}\n")
    out.flush()


def job_tls(cfg: MasterConfig, run_dir: str) -> tuple[ServerTLS | None, ClientTLS | None]:
    """The master's TLS credentials and the ones its nodes get, from the TLS settings."""
    if cfg.tls_cert:
        return ServerTLS(cfg.tls_cert, cfg.tls_key), ClientTLS(cfg.tls_ca)
    if not cfg.tls_auto:
        return None, None
    tls_dir = os.path.join(run_dir, "tls")
    if os.path.exists(os.path.join(tls_dir, "node.key")):  # a restarted master: same CA
        d = functools.partial(os.path.join, tls_dir)
        return (
            ServerTLS(d("master.pem"), d("master.key"), d("ca.pem")),
            ClientTLS(d("ca.pem"), d("node.pem"), d("node.key")),
        )
    return make_job_certificates(tls_dir, [advertised_host(cfg.host)])


# Server threads a node may hold at once in long calls: its progress stream, the KV waits of
# its pause and checkpoint watchers (TF) or its rendezvous watch (torch), a blocking shard ask.
THREADS_PER_NODE = 4


def rpc_threads(configured: int, spec: JobSpec) -> int:
    """gRPC server threads: enough that long-lived calls of every node the job may run leave
    threads for heartbeats and shard asks (a sync server holds a thread per open call)."""
    return max(configured, THREADS_PER_NODE * spec.max_nodes + 64)


def open_run_state(layout: RunLayout) -> StateStore:
    """The run's state store; one in memory is said to keep nothing past this master."""
    if in_memory(layout.state):
        log.warning(
            "the state is in memory (--state %s): no durability; a master that dies ends "
            "the job, and the run cannot be resumed",
            layout.state,
        )
    return open_state_store(layout.state, job=layout.namespace)


def run_job(spec: JobSpec, opts: SubmitOptions, out: TextIO = sys.stdout) -> int:
    """Run the job's master here, its nodes on the chosen platform; the exit code says how the
    job ended (master.cli.exit_codes). The state is where `opts.master.state_path` says
    (':memory:': in memory)."""
    cfg = opts.master
    layout = run_layout(spec, opts.run_dir, cfg.state_path, cfg.host)
    run_dir = layout.run_dir
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    token_file = layout.token_file
    if opts.resume:
        # Running nodes hold the token file's path: keep the file and the token in it.
        cfg = replace(cfg, job_token=read_token({ENV_JOB_TOKEN_FILE: token_file}))
    else:
        write_token(token_file, cfg.job_token)
    spec, brain, brain_notes = consult_brain(spec, opts.brain)
    store = open_run_state(layout)
    platform = create_platform(opts.platform, advertised_host(cfg.host), opts.platform_options)
    printer = ProgressPrinter(out, opts.status_interval) if not opts.quiet else None
    server_tls, node_tls = job_tls(cfg, run_dir)
    runtime = JobRuntime(
        run_dir=run_dir,
        master_addr="",
        token_file=token_file,
        node_env=node_tls.env() if node_tls else {},
    )
    job = JobMaster(
        spec,
        platform,
        store,
        runtime,
        faults=opts.faults,
        on_event=printer.event if printer else None,
        resuming=opts.resume,
    )
    if brain is not None and job.autoscaler is not None and not opts.resume:
        job.autoscaler.seed(*brain_hint(brain, spec))  # the best worker count of past runs
    observability = Observability(job, cfg.host, spec.metrics_port, tls=server_tls)
    start = start_aio_server if cfg.rpc_server == "aio" else start_server
    server, port = start(
        job,
        cfg.host,
        cfg.port,
        cfg.job_token,
        rpc_threads(cfg.max_workers, spec),
        int(
            heartbeat_interval(cfg.heartbeat_interval_seconds, spec.heartbeat_timeout_seconds)
            * 1000
        ),
        interceptors=observability.interceptors(),
        tls=server_tls,
    )
    runtime.master_addr = f"{advertised_host(cfg.host)}:{port}"
    dashboard = observability.start(advertised_host(cfg.host))
    if not opts.quiet:
        out.write(
            f"== job {spec.name}: master at {runtime.master_addr}, run dir {run_dir}\n"
            f"   nodes: "
            + ", ".join(
                f"{spec.group(t).replicas} {t}" for t in ("ps", "chief", "worker", "evaluator")
            )
            + "\n"
            f"   dashboard {dashboard}  metrics {dashboard}metrics  "
            f"(token in {observability.token_file}; `dlrover status --show-dashboard-token`)\n"
        )
        for fault in opts.faults:
            out.write(f"   fault injection planned: {fault.describe()}\n")
        for note in brain_notes:
            out.write(f"   {note}\n")
        out.flush()

    def on_signal(signum: int, frame: object) -> None:
        job.request_stop(f"interrupted by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if printer:
        printer.start(job)
    try:
        with serving_gc():
            job.run(resume=opts.resume)
    finally:
        if printer:
            printer.stop()
        server.stop(grace=1).wait()
        observability.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        summary = build_summary(job)
        report_to_brain(brain, job)
        store.close()
    if opts.summary_json:
        with open(opts.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if not opts.quiet:
        print_summary(summary, out)
    return job_exit_code(summary["status"])
