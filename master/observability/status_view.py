"""The job's status as one JSON document (dashboard, `dlrover status`) and as a text screen."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from master.job.events import INCIDENT_KINDS
from master.nodes.model import Finding

if TYPE_CHECKING:
    from master.job.master import JobMaster
    from master.observability.telemetry import JobTelemetry

log = logging.getLogger(__name__)

RECENT_EVENTS = 12
CLEAR_SCREEN = "\x1b[H\x1b[2J"
TYPE_ORDER = ("ps", "chief", "worker", "evaluator")


def status_document(job: JobMaster, telemetry: JobTelemetry | None = None) -> dict[str, Any]:
    """Everything a live view shows: job, throughput, data per dataset/epoch, nodes, events."""
    latest = telemetry.latest() if telemetry else None
    history = job.nodes.history()
    incarnations: dict[tuple[str, int], int] = {}
    for n in history:
        incarnations[(n.type, n.rank)] = incarnations.get((n.type, n.rank), 0) + 1
    nodes = []
    for n in sorted(job.nodes.all_current(), key=lambda n: (_type_index(n.type), n.rank)):
        diagnosis = n.diagnosis
        cause = n.stop_cause if n.exit_reason.value == "stopped" else ""
        note = f"stopped: {cause}" if cause else diagnosis.summary if diagnosis else ""
        nodes.append(
            {
                "name": n.name,
                "type": n.type,
                "rank": n.rank,
                "id": n.id,
                "state": n.state.value,
                "exit_reason": n.exit_reason.value,
                "relaunches": n.relaunches,
                "incarnations": incarnations[(n.type, n.rank)],
                "address": n.address,
                "cpu_percent": round(n.cpu_percent, 1),
                "memory_rss_bytes": n.memory_rss_bytes,
                "memory_mb": n.memory_mb,
                "steps": n.steps,
                "step_seconds": round(n.step_seconds, 5),
                "straggler": Finding.STRAGGLER in n.findings,
                "diagnosis": note,
            }
        )
    datasets = []
    for s in job.sharding.stats():
        epoch = min(max(s.current_epoch, 0), max(s.epochs - 1, 0))
        datasets.append(
            {
                "name": s.name,
                "size": s.size,
                "epochs": s.epochs,
                "current_epoch": epoch,
                "epoch_records_done": min(max(0, s.records_done - epoch * s.size), s.size),
                "records_done": s.records_done,
                "records_total": s.size * s.epochs,
                "records_redone": s.records_redone,
                "records_todo": s.records_todo,
                "records_doing": s.records_doing,
                "finished": s.finished,
            }
        )
    events = [e.to_dict() for e in job.event_log.since(max(0, len(job.event_log) - 200))]
    return {
        "name": job.spec.name,
        "state": job.state.value,
        "reason": job.reason,
        "stuck": getattr(job, "stuck_note", ""),
        "global_step": job.global_step,
        "elapsed_seconds": round(job.elapsed(), 3),
        "started_at": time.time() - job.elapsed(),
        "cluster_version": job.cluster_version,
        "steps_per_second": round(latest.steps_per_second, 3) if latest else 0.0,
        "records_per_second": round(latest.records_per_second, 3) if latest else 0.0,
        "datasets": datasets,
        "nodes": nodes,
        "events": [e for e in events if e["kind"] not in ("node_running",)][-RECENT_EVENTS:],
        "event_count": len(job.event_log),
        "run_dir": job.runtime.run_dir,
        "master_addr": job.runtime.master_addr,
        "autoscale": _autoscale(job),
    }


def _autoscale(job: JobMaster) -> dict[str, Any]:
    """The auto-scaler's last decision and current reasoning ({"enabled": False} when off)."""
    scaler = getattr(job, "autoscaler", None)
    return scaler.status() if scaler is not None else {"enabled": False}


def _type_index(node_type: str) -> int:
    return TYPE_ORDER.index(node_type) if node_type in TYPE_ORDER else len(TYPE_ORDER)


def _bar(fraction: float, width: int = 24) -> str:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.1f}"


def render_status(doc: dict[str, Any], now: float | None = None) -> str:
    """The `dlrover status` screen for a status document: plain text, no terminal codes."""
    lines = [
        f"job {doc['name']}: {doc['state']}" + (f" ({doc['reason']})" if doc.get("reason") else ""),
        f"  step {doc['global_step']:,}   elapsed {doc['elapsed_seconds']:.1f}s   "
        f"{_rate(doc['steps_per_second'])} steps/s   {_rate(doc['records_per_second'])} records/s"
        f"   cluster v{doc['cluster_version']}",
        *([f"  {doc['stuck']}"] if doc.get("stuck") else []),
        "",
        "data",
    ]
    if not doc["datasets"]:
        lines.append("  (no dataset registered yet)")
    for d in doc["datasets"]:
        total = d["records_total"] or 1
        lines.append(
            f"  {d['name']:<12} epoch {d['current_epoch'] + 1}/{d['epochs']} "
            f"{_bar(d['epoch_records_done'] / max(d['size'], 1))} "
            f"{d['epoch_records_done']:,}/{d['size']:,}   "
            f"all epochs {100 * d['records_done'] / total:5.1f}%   todo {d['records_todo']:,} "
            f"doing {d['records_doing']:,} redone {d['records_redone']:,}"
        )
    lines += [
        "",
        "nodes",
        f"  {'NODE':<12} {'ID':>4}  {'STATE':<10} {'RELAUNCH':>8}  {'CPU%':>6} {'RSS MB':>7} "
        f"{'STEPS':>7} {'MS/STEP':>8}  NOTE",
    ]
    for n in doc["nodes"]:
        note = n["diagnosis"] or n["exit_reason"]
        if n["straggler"]:
            note = ("straggler " + note).strip()
        step_ms = f"{n['step_seconds'] * 1000:.1f}" if n["steps"] > 1 else "-"
        lines.append(
            f"  {n['name']:<12} {n['id']:>4}  {n['state']:<10} {n['relaunches']:>8}  "
            f"{n['cpu_percent']:>6.1f} {n['memory_rss_bytes'] / 2**20:>7.0f} {n['steps']:>7} "
            f"{step_ms:>8}  {note}".rstrip()
        )
    auto = doc.get("autoscale") or {}
    if auto.get("enabled"):
        lines += ["", "autoscale"]
        if auto.get("last_decision"):
            when = ""
            if "last_decision_at" in auto:  # not in the gRPC-only document
                ago = (now or time.time()) - auto["last_decision_at"]
                when = f" ({auto['decisions']} in all, {ago:.0f}s ago)"
            lines.append(f"  last decision{when}: {auto['last_decision']}")
        lines.append(f"  now: {auto.get('note') or '-'}")
        table = auto.get("throughput_table") or {}
        if table:
            lines.append(
                "  records/s by workers: "
                + ", ".join(f"{k}: {_rate(v)}" for k, v in sorted(table.items(), key=_by_count))
            )
    lines += ["", f"recent events ({doc['event_count']} in all)"]
    started = doc.get("started_at", 0.0)
    for e in doc["events"][-8:]:
        marker = "!!" if e["kind"] in INCIDENT_KINDS else "=>"
        message = e["message"].splitlines()[0] if e["message"] else ""
        lines.append(f"  {marker} [{e['time'] - started:7.1f}s] {e['kind']:<14} {message}")
    return "\n".join(lines) + "\n"


def _by_count(item: tuple[str, float]) -> int:
    return int(item[0]) if item[0].isdigit() else 0


def document_from_status_pb(status: Any) -> dict[str, Any]:
    """A status document from the gRPC JobStatus alone (a master without its HTTP endpoint)."""
    return {
        "name": status.name,
        "state": status.status,
        "reason": status.reason,
        "global_step": status.global_step,
        "elapsed_seconds": status.elapsed_seconds,
        "started_at": time.time() - status.elapsed_seconds,
        "cluster_version": status.cluster_version,
        "steps_per_second": 0.0,
        "records_per_second": 0.0,
        "datasets": [
            {
                "name": d.name,
                "size": d.size,
                "epochs": d.epochs,
                "current_epoch": min(d.current_epoch, max(d.epochs - 1, 0)),
                "epoch_records_done": min(
                    max(0, d.records_done - min(d.current_epoch, d.epochs - 1) * d.size), d.size
                ),
                "records_done": d.records_done,
                "records_total": d.size * d.epochs,
                "records_redone": d.records_redone,
                "records_todo": d.records_todo,
                "records_doing": d.records_doing,
                "finished": d.finished,
            }
            for d in status.datasets
        ],
        "nodes": [
            {
                "name": f"{n.type}-{n.rank}",
                "type": n.type,
                "rank": n.rank,
                "id": n.id,
                "state": n.status,
                "exit_reason": n.exit_reason,
                "relaunches": n.relaunches,
                "address": n.address,
                "cpu_percent": 0.0,
                "memory_rss_bytes": 0,
                "steps": 0,
                "step_seconds": 0.0,
                "straggler": False,
                "diagnosis": "",
            }
            for n in _current_nodes(status.nodes)
        ],
        "events": [],
        "event_count": 0,
        "autoscale": {
            "enabled": bool(status.autoscale_decision or status.autoscale_note),
            "last_decision": status.autoscale_decision,
            "note": status.autoscale_note,
        },
    }


def _current_nodes(nodes: Any) -> list[Any]:
    latest: dict[tuple[str, int], Any] = {}
    for n in nodes:
        if (n.type, n.rank) not in latest or n.id > latest[(n.type, n.rank)].id:
            latest[(n.type, n.rank)] = n
    return sorted(latest.values(), key=lambda n: (_type_index(n.type), n.rank))


@dataclass(frozen=True)
class DashboardAccess:
    """How `dlrover status` reads the dashboard: its token ("" if unknown), the CA that signed an
    HTTPS dashboard's certificate, and whether to print the login link (token included)."""

    token: str = ""
    token_file: str = ""
    ca_file: str = ""
    show_token: bool = False


def fetch_document(
    client: Any, timeout: float = 10.0, access: DashboardAccess | None = None
) -> dict[str, Any]:
    """The job's status document: the master's /api/status, or the gRPC status if unreachable.
    Either way "dashboard_url" says where the dashboard is (no token in it)."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    access = access or DashboardAccess()
    status = client.job_status()
    doc = None
    if status.dashboard_url and access.token:
        url = status.dashboard_url.rstrip("/") + "/api/status"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {access.token}"})
        context = None
        if url.startswith("https:"):
            context = ssl.create_default_context(cafile=access.ca_file or None)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
                doc = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError, ssl.SSLError) as e:
            log.warning("cannot read %s (%s); showing the gRPC status only", url, e)
    if doc is None:
        doc = document_from_status_pb(status)
    doc["dashboard_url"] = status.dashboard_url
    return doc


def dashboard_line(doc: dict[str, Any], access: DashboardAccess) -> str:
    """Where the dashboard is and how to open it; the token only when asked for."""
    url = doc.get("dashboard_url") or ""
    if not url:
        return ""
    if access.show_token and access.token:
        return (
            f"dashboard {url}?token={access.token}\n"
            "  (this link logs a browser in, then drops the token from the address; "
            "it is a password: do not share it)\n"
        )
    where = access.token_file or "RUN_DIR/.dashboard_token"
    return (
        f"dashboard {url}\n"
        f"  (to open it: `dlrover status ... --show-dashboard-token` prints a login link; "
        f"scripts send 'Authorization: Bearer' with the token in {where})\n"
    )


def show_status(
    client: Any, watch_seconds: float, out: TextIO, access: DashboardAccess | None = None
) -> int:
    """Print the status screen once, or (watch_seconds > 0) redraw it until the job ends."""
    from master.client import MasterError

    access = access or DashboardAccess()
    ended = ("succeeded", "failed", "stopped")
    shown = 0
    while True:
        try:
            doc = fetch_document(client, access=access)
        except MasterError as e:
            if shown and watch_seconds > 0:
                # The master stops serving right after its job ends.
                out.write(f"\nthe master stopped answering ({e.code.name if e.code else e})\n")
                return 0
            print(f"dlrover: error: {e}", file=sys.stderr)
            return 2
        shown += 1
        line = dashboard_line(doc, access)
        screen = render_status(doc) + ("\n" + line if line else "")
        if watch_seconds > 0:
            out.write(CLEAR_SCREEN + screen + f"\n(every {watch_seconds:g}s; Ctrl-C to quit)\n")
        else:
            out.write(screen)
        out.flush()
        if watch_seconds <= 0 or doc["state"] in ended:
            return 0
        try:
            time.sleep(watch_seconds)
        except KeyboardInterrupt:
            return 0
