"""PS failure recovery: time until training resumes and steps lost, against a full restart.

Both runs train the TF example (1 PS, chief, 2 workers) and lose the PS at about the same
global step (`--kill-step`, or later once the standby PS is ready):

- elastic: the PS's process group SIGKILLed (as `--kill ps:0@step=N` does); the master
  promotes the standby (or relaunches the PS), sessions are rebuilt, the chief restores the
  latest checkpoint and the data rolls back with it.
- baseline: the whole job is stopped at that step (the master and every node killed) and
  started again from the latest checkpoint in the same model dir, the manual recovery without
  an elastic master (its data position restarts from scratch, not measured here).

- migration: `dlrover migrate ps-0 --memory-mb M` at the same step: the chief checkpoints at
  its next step, the PS is replaced at the same address with the new memory, the chief
  restores that checkpoint (`dlrover_tf.elastic_model_fn`), workers resume.

Recovery time = from the failure (or the migrate call) to the first step that moves the data
forward again, polled every 0.2 s through a client of the master; the full restart is charged
the elastic run's detection time too (a user's restart notices the failure no sooner). Both
sides checkpoint by the same policy (`--checkpoint-overhead`: the master sets the chief's
interval) and count steps lost the same way: the global step the master had seen at the failure
minus the step of the checkpoint restored (the elastic run also shows the records its rollback
sent back, which counts every step taken).

Then the failures of `ps_failures.py`, each trained to its end with every trained id logged: a
frozen PS (SIGSTOP, found by the heartbeat timeout), a PS lost with no standby ready, and (on a
multi-node Ray cluster) the Ray node holding ps-0 removed.

Each recovery's timeline comes from the job's `recovery` event (master.job.recovery_timeline):
failure detected, PS process started (or the standby promoted), PS serving, sessions rebuilt
and checkpoint restored (the chief's report), workers told, first step; the full restart's from
its second master's start. With the standby PS on (the default; `--no-standby` turns it off in
every run), its cost is measured too: the standby's CPU seconds and RSS while it waits, and
steps/s before the failure with it (elastic run) and without it (the baseline's first run).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml
from common import ROOT, cpu_seconds, use_checkout

use_checkout()
from ps_failures import detected_after, failure_run, host_loss_run  # noqa: E402

from master.client import MasterClient, MasterError, read_token  # noqa: E402
from master.job.recovery_timeline import PHASE_LABELS  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "tf")
POLL_SECONDS = 0.2
JOB_CHECKPOINT_STEPS = 500  # the example's save_checkpoints_steps
EPOCHS = 2  # the example job's
_STATUS_STEP = re.compile(r"global step (\d+)")
_STATUS_DONE = re.compile(r"dataset train: ([\d,]+)/")


def batch_size() -> int:
    """The example job's batch size (records per step)."""
    with open(os.path.join(EXAMPLE, "job.yaml")) as f:
        command = yaml.safe_load(f)["command"]
    return int(command[command.index("--batch-size") + 1])


def write_job(
    workdir: str, records: int, standby: bool, name: str = "job.yaml", overhead: float = 0.0
) -> str:
    with open(os.path.join(EXAMPLE, "job.yaml")) as f:
        job = yaml.safe_load(f)
    command = list(job["command"])
    command[1] = os.path.join(EXAMPLE, "wide_deep.py")
    command[command.index("--records") + 1] = str(records)
    job.update(command=command, workdir=workdir, name="ps-recovery", ps_standby=standby)
    if overhead:
        job["checkpoint_overhead"] = overhead
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


class Job:
    """A `dlrover submit` in the background, watched through a client of its master."""

    def __init__(self, job_yaml: str, run_dir: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "master.cli", "submit", job_yaml, "--run-dir", run_dir]
        cmd += ["--status-interval", "3600", "--summary-json", os.path.join(run_dir, "s.json")]
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        first = self.proc.stdout.readline()
        self.addr = first.split("master at ")[1].split(",")[0]
        self.token_file = os.path.join(run_dir, ".job_token")
        token = read_token({"DLROVER_JOB_TOKEN_FILE": self.token_file})
        # Polled in process (a `dlrover status` process per poll would load the machine).
        self.client = MasterClient(self.addr, token, retry_seconds=1.0, call_timeout=10.0)

    def status(self) -> tuple[int, int] | None:
        """(global step, records done), or None once the job is gone."""
        try:
            st = self.client.job_status()
        except MasterError:
            return None
        if st.status in ("succeeded", "failed", "stopped"):
            return None
        return st.global_step, sum(d.records_done for d in st.datasets)

    def rate_until(self, step: int) -> tuple[float, int, int, float]:
        """wait_step(step), plus the steps/s from a third of the way there to `step`."""
        t0, s0, _ = self.wait_step(step // 3)
        t1, s1, done = self.wait_step(step)
        return t1, s1, done, (s1 - s0) / max(t1 - t0, 1e-9)

    def wait_step(self, step: int, timeout: float = 600.0) -> tuple[float, int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status()
            if s and s[0] >= step:
                return time.monotonic(), s[0], s[1]
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"global step {step} not reached")

    def finish(self, timeout: float = 900.0, stop: bool = False) -> dict:
        """The job's summary once it ended (with `stop`: stopped now, as Ctrl-C does)."""
        if stop:
            time.sleep(2.0)  # the recovery event is written once the first step is reported
            self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=timeout)
        run_dir = os.path.dirname(self.token_file)
        with open(os.path.join(run_dir, "s.json")) as f:
            return json.load(f)


def _watch_resume(job: Job, done_before: int) -> float | None:
    """Wall time at which the data moves forward again after its rollback (None: job ended)."""
    low = None  # records done once the rollback has happened
    while True:
        s = job.status()
        if s is None:
            return None
        if low is None and s[1] < done_before:
            low = s[1]
        elif low is not None and s[1] > low:
            return time.time()
        elif low is None:
            done_before = max(done_before, s[1])
        time.sleep(POLL_SECONDS)


def _watch_advance(job: Job, done: int) -> float | None:
    """Wall time at which more records than `done` are trained (None: the job ended)."""
    while True:
        s = job.status()
        if s is None:
            return None
        if s[1] > done:
            return time.time()
        time.sleep(POLL_SECONDS)


def _timeline(summary: dict, kind: str) -> dict | None:
    """The last recovery timeline of `kind` the job recorded (its event's details)."""
    found = [e["details"] for e in summary["events"] if e["kind"] == "recovery"]
    found = [d for d in found if d.get("recovery") == kind]
    return found[-1] if found else None


def _standby_cost(run_dir: str, seconds: float = 2.0) -> dict | None:
    """CPU (cores, over `seconds`) and RSS of the job's waiting standby PS, from /proc."""
    pid = _find_process(run_dir, "dlrover_tf.ps_standby")
    if pid is None:
        return None
    try:
        cpu0 = cpu_seconds(pid)
        time.sleep(seconds)
        cpu1 = cpu_seconds(pid)
        with open(f"/proc/{pid}/status") as f:
            rss_kb = int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1])
    except (OSError, StopIteration):
        return None
    return {
        "cpu_cores_while_waiting": round((cpu1 - cpu0) / seconds, 4),
        "cpu_seconds_to_load": round(cpu0, 2),
        "rss_mb": round(rss_kb / 1024, 1),
    }


def _find_process(run_dir: str, module: str) -> int | None:
    """The pid of the job's `python -m module` process (not its orphan guard)."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv[1:3] != [b"-m", module.encode()]:
                continue  # not the standby itself (e.g. its orphan guard)
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"DLROVER_RUN_DIR={run_dir}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    return None


def _wait_standby_ready(job: Job, timeout: float = 120.0) -> float | None:
    """Seconds until the job's standby PS says it is ready (None: no standby)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout and job.status() is not None:
        path = os.path.join(os.path.dirname(job.token_file), "events.jsonl")
        try:
            with open(path) as f:
                if any('"ps_standby"' in ln and '"ready"' in ln for ln in f):
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(POLL_SECONDS)
    return None


def _interval(summary: dict, before: float) -> dict:
    """The checkpoint interval in force at `before`: the master's last choice, or the job's."""
    chosen = [
        e["details"]
        for e in summary["events"]
        if e["kind"] == "checkpoint_interval" and e["time"] < before
    ]
    if chosen:
        return {"steps": chosen[-1]["steps"], "set_by": "master", **chosen[-1]}
    return {"steps": JOB_CHECKPOINT_STEPS, "set_by": "job (RunConfig)"}


def _restored_step(summary: dict) -> int:
    rollback = [e["message"] for e in summary["events"] if e["kind"] == "rollback"]
    return int(rollback[-1].split("checkpoint step ")[1].split(" ")[0]) if rollback else 0


def _records_rolled_back(summary: dict) -> int:
    """Records the job's rollback events sent back to be trained again."""
    return sum(
        e["details"].get("records_to_redo", 0) for e in summary["events"] if e["kind"] == "rollback"
    )


def elastic_run(job_yaml: str, workdir: str, kill_step: int, standby: bool) -> dict:
    """The PS's process group SIGKILLed (as `--kill` does) at `kill_step`, or once the
    standby is ready if that is later: a standby is ready long before a failure in a job
    that runs for hours, but not necessarily 800 steps into this one."""
    run_dir = os.path.join(workdir, "elastic")
    job = Job(job_yaml, run_dir)
    _, _, _, rate = job.rate_until(kill_step)
    cost = None
    if standby:
        _wait_standby_ready(job)
        cost = _standby_cost(run_dir)
    step_at_kill, done_before = job.status()
    pid = _find_process(run_dir, "dlrover_tf.ps")
    killed = time.time()
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    resumed = _watch_resume(job, done_before)
    summary = job.finish(stop=True)
    ckpt = _restored_step(summary)
    # Steps lost are counted as for the full restart (the step the master had seen minus the
    # checkpoint's); the records the rollback sent back (every step taken) are shown too.
    redo = _records_rolled_back(summary)
    return {
        "recovery_seconds": round((resumed or time.time()) - killed, 2),
        "global_step_at_failure": step_at_kill,
        "restored_from_step": ckpt,
        "records_to_train_again": redo,
        "steps_lost": max(0, step_at_kill - ckpt),
        "detected_seconds": detected_after(_timeline(summary, "ps_failure"), killed),
        "job_status": summary["status"],
        "wall_seconds": summary["wall_seconds"],
        "steps_per_second_before_failure": round(rate, 2),
        "standby_cost": cost,
        "checkpoint_interval": _interval(summary, killed),
        "timeline": _timeline(summary, "ps_failure"),
    }


def migration_run(job_yaml: str, workdir: str, at_step: int, memory_mb: int) -> dict:
    """`dlrover migrate ps-0 --memory-mb M` at a global step: checkpoint, replace, restore."""
    run_dir = os.path.join(workdir, "migration")
    job = Job(job_yaml, run_dir)
    _, _, _, rate = job.rate_until(at_step)
    _wait_standby_ready(job)
    asked = time.time()
    reply = job.client.migrate("ps", 0, memory_mb=memory_mb, reason="benchmark")
    moved = time.time()
    # Nothing is rolled back when the pause held: training is back once the data moves on.
    at_move = job.status()
    resumed = _watch_advance(job, at_move[1]) if at_move else None
    summary = job.finish(stop=True)
    redo = _records_rolled_back(summary)
    return {
        "migrate_call_seconds": round(moved - asked, 2),
        "recovery_seconds": round((resumed or time.time()) - asked, 2),
        "checkpoint_step": reply.checkpoint_step,
        "restored_from_step": _restored_step(summary) or reply.checkpoint_step,
        "records_to_train_again": redo,
        "steps_lost": -(-redo // batch_size()),
        "job_status": summary["status"],
        "wall_seconds": summary["wall_seconds"],
        "steps_per_second_before": round(rate, 2),
        "timeline": _timeline(summary, "ps_migration"),
    }


def baseline_run(job_yaml: str, workdir: str, kill_step: int, detection: float) -> dict:
    """The job (with no standby PS: a manual restart has none) killed whole, then restarted;
    charged `detection` seconds for noticing the failure (the elastic run's, measured)."""
    first_dir = os.path.join(workdir, "baseline-1")
    job = Job(job_yaml, first_dir)
    _, step_at_kill, _, rate = job.rate_until(kill_step)
    t_fail = time.time()
    job.proc.send_signal(signal.SIGKILL)  # the orphan guard takes every node with it
    job.proc.wait()
    second_dir = os.path.join(workdir, "baseline-2")
    os.makedirs(second_dir)
    shutil.copytree(os.path.join(first_dir, "model"), os.path.join(second_dir, "model"))
    with open(os.path.join(second_dir, "model", "checkpoint")) as f:
        ckpt = int(re.search(r'model_checkpoint_path: ".*-(\d+)"', f.read()).group(1))
    restart = Job(job_yaml, second_dir)
    while True:
        s = restart.status()
        if s and s[1] > 0:
            resumed = time.time()
            break
        time.sleep(POLL_SECONDS)
    # The timeline closes at the first step the chief's restore report is followed by.
    time.sleep(1.0)
    restart.proc.send_signal(signal.SIGINT)
    restart.proc.communicate(timeout=120)
    timeline = None
    try:
        with open(os.path.join(second_dir, "s.json")) as f:
            timeline = _timeline(json.load(f), "job_start")
    except (OSError, ValueError):
        pass
    if timeline is not None:
        # From the failure, not from the second master's start.
        shift = timeline["started"] - t_fail
        timeline["phases"] = {"master_started": round(shift, 3)} | {
            p: round(t + shift, 3) for p, t in timeline["phases"].items()
        }
        timeline["seconds"] = round(timeline["seconds"] + shift, 3)
    return {
        "recovery_seconds": round(resumed - t_fail + detection, 2),
        "detection_charged_seconds": detection,
        "global_step_at_failure": step_at_kill,
        "restored_from_step": ckpt,
        "steps_lost": max(0, step_at_kill - ckpt),
        "steps_per_second_before_failure": round(rate, 2),
        "timeline": timeline,
    }


def format_timeline(timeline: dict | None) -> str:
    """'  +0.01 failure detected | +0.05 PS process started | ...' (or why there is none)."""
    if not timeline:
        return "  (no timeline recorded)"
    labels = {"master_started": "new master started", **PHASE_LABELS}
    return "  " + " | ".join(f"+{t:.2f} {labels.get(p, p)}" for p, t in timeline["phases"].items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Long enough for the standby to load on a loaded machine; each run stops once measured.
    p.add_argument("--records", type=int, default=1_280_000)
    p.add_argument("--kill-step", type=int, default=800)
    p.add_argument("--memory-mb", type=int, default=2048, help="the migrated PS's memory")
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--only-migration", action="store_true", help="skip the PS failure runs")
    p.add_argument(
        "--only-host-loss", action="store_true", help="only the Ray host-loss run (no ratios)"
    )
    p.add_argument("--no-standby", action="store_true", help="no standby PS in any run")
    p.add_argument(
        "--checkpoint-overhead",
        type=float,
        default=0.2,
        help="the elastic run's checkpoint_overhead: the master sets the chief's checkpoint "
        "interval so saving costs this fraction of the time (0: the job's 500 steps)",
    )
    p.add_argument(
        "--failure-records",
        type=int,
        default=640_000,
        help="records of the frozen-PS and no-standby runs (trained to their end)",
    )
    p.add_argument(
        "--ray-nodes",
        type=int,
        default=3,
        help="Ray nodes of the multi-node cluster the host-loss run starts (0: no such run)",
    )
    p.add_argument("--keep", metavar="DIR", help="run in DIR (kept) instead of a temporary one")
    args = p.parse_args()
    standby = not args.no_standby
    if args.keep:
        os.makedirs(args.keep)
    with (
        contextlib.nullcontext(args.keep)
        if args.keep
        else tempfile.TemporaryDirectory(prefix="bench-ps-") as workdir
    ):
        if args.only_host_loss:
            short = write_job(
                workdir, args.failure_records, standby, "host_loss-base.yaml",
                args.checkpoint_overhead,
            )  # fmt: skip
            r = host_loss_run(
                sys.modules[__name__], short, workdir, args.kill_step, args.failure_records,
                EPOCHS, standby, args.ray_nodes,
            )  # fmt: skip
            print(format_timeline(r["timeline"]))
            print(json.dumps({"benchmark": "ps_recovery", "host_loss": r}))
            return 0
        job_yaml = write_job(workdir, args.records, standby)
        migration = migration_run(job_yaml, workdir, args.kill_step, args.memory_mb)
        if args.only_migration:
            print(format_timeline(migration["timeline"]))
            print(json.dumps({"benchmark": "ps_recovery", "ps_migration": migration}))
            return 0
        tuned_yaml = write_job(
            workdir, args.records, standby, "tuned.yaml", args.checkpoint_overhead
        )
        elastic = elastic_run(tuned_yaml, workdir, args.kill_step, standby)
        # The same checkpoint interval policy as the elastic run, with no standby.
        plain_yaml = write_job(workdir, args.records, False, "plain.yaml", args.checkpoint_overhead)
        baseline = baseline_run(
            plain_yaml, workdir, args.kill_step, elastic["detected_seconds"] or 0.0
        )
        failures = {}
        for key, kind, with_standby in (
            ("frozen_ps", "frozen", standby),
            ("no_standby", "no_standby", False),
        ):
            short = write_job(
                workdir,
                args.failure_records,
                with_standby,
                f"{kind}-base.yaml",
                args.checkpoint_overhead,
            )
            failures[key] = failure_run(
                sys.modules[__name__],
                short,
                workdir,
                kind,
                args.kill_step,
                args.failure_records,
                EPOCHS,
                with_standby,
            )
        if args.ray_nodes and importlib.util.find_spec("ray") is not None:
            short = write_job(
                workdir,
                args.failure_records,
                standby,
                "host_loss-base.yaml",
                args.checkpoint_overhead,
            )
            failures["host_loss"] = host_loss_run(
                sys.modules[__name__],
                short,
                workdir,
                args.kill_step,
                args.failure_records,
                EPOCHS,
                standby,
                args.ray_nodes,
            )
        else:
            failures["host_loss"] = {
                "skipped": "no multi-node Ray cluster (--ray-nodes 0, or ray not installed)"
            }
    ratio = baseline["recovery_seconds"] / max(elastic["recovery_seconds"], 1e-9)
    if not args.json_only:
        for name, r in (("elastic", elastic), ("full restart", baseline)):
            print(
                f"{name:13s}: training resumed {r['recovery_seconds']:6.1f} s after the PS failure"
                f" (the master had seen step {r['global_step_at_failure']}), from checkpoint step "
                f"{r['restored_from_step']} ({r['steps_lost']} steps to redo"
                + (")" if "records_to_train_again" in r else ", at least: from the step seen)")
            )
            if "checkpoint_interval" in r:
                ci = r["checkpoint_interval"]
                print(f"  checkpoint interval {ci['steps']} steps (set by the {ci['set_by']})")
            print(format_timeline(r["timeline"]))
        print(
            f"PS migration : training resumed {migration['recovery_seconds']:6.1f} s after "
            f"`dlrover migrate` (the call took {migration['migrate_call_seconds']:.1f} s), "
            f"checkpoint step {migration['checkpoint_step']}, "
            f"{migration['steps_lost']} steps to redo"
        )
        print(format_timeline(migration["timeline"]))
        print(f"recovery time: full restart / elastic = {ratio:.2f}x")
        for key, r in failures.items():
            if "skipped" in r:
                print(f"{key:13s}: skipped ({r['skipped']})")
                continue
            print(
                f"{key:13s}: detected {r['detected_seconds']} s after the failure, training "
                f"resumed {r['recovery_seconds']:.1f} s after it, {r['steps_lost']} steps lost, "
                f"{r['records_missing']} records missing, {r['records_trained_more']} trained "
                f"more than {EPOCHS}x ({r['job_status']})"
            )
            print(format_timeline(r["timeline"]))
        cost = elastic["standby_cost"]
        if cost:
            print(
                f"standby PS: {cost['rss_mb']:.0f} MB RSS, {cost['cpu_cores_while_waiting']:.3f} "
                f"cores while waiting ({cost['cpu_seconds_to_load']:.1f} CPU s to load)"
            )
        print(
            f"steps/s before the failure or move: {baseline['steps_per_second_before_failure']:.1f}"
            f" with neither a standby nor a tuned interval (full restart's first run), "
            f"{migration['steps_per_second_before']:.1f} with {'a' if standby else 'no'} standby "
            f"(migration run), {elastic['steps_per_second_before_failure']:.1f} with "
            f"{'a' if standby else 'no'} standby and the tuned interval (elastic run)"
        )
    print(
        json.dumps(
            {
                "benchmark": "ps_recovery",
                "ps_failure": {"elastic": elastic, "full_restart": baseline},
                "ps_migration": migration,
                **failures,
                "recovery_speedup": round(ratio, 3),
                "standby": standby,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
