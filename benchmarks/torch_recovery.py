"""Torch worker recovery: dlrover-run beside torchrun and DLRover, same DDP script, same run.

Each launcher runs ``examples/torch/train.py`` (2 processes, gloo on CPU, DDP, checkpoints with
torch.save). ``--settle`` seconds (3 by default) after its group entered the training loop, the
benchmark SIGKILLs the rank-1 worker (an early crash: nothing waits for spare workers to be
ready) and measures, from the kill:

- ``pg_ready``: until every rank of the new group has returned from ``init_process_group``
  (detection, stop, rendezvous, process start; the launcher's own share, target <= 0.3 s);
- ``loop``: until every rank is back in its training loop (adds the script rebuilding its
  model and DDP and loading the checkpoint);
- ``step``: until every rank finished its first step again (target: at most 0.6x torchrun's).

Every launcher gets ``--trials`` kills in one run (a restart each). A launcher may spend further
restarts before its group is back (torchrun's restarted workers can fail with ``Gloo
connectFullMesh failed ... Connection refused`` to the old group's address): those count as
``extra_restarts`` and the time runs on. A kill after which no group steps again within
``--trial-timeout`` counts as not recovered (a hang), and the launcher is started again.
torchrun runs twice: as users run it (c10d rendezvous, its store shared with the workers) and
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. DLRover 0.6.1's dlrover-run runs too when the anchors
environment exists (``make anchors``), with its own job master started beside it.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import anchors
from common import ROOT

SCRIPT = os.path.join(ROOT, "examples", "torch", "train.py")
BIN = os.path.dirname(sys.executable)
POLL_SECONDS = 0.02
# torchrun as users run it, and with the workaround that keeps it from reusing a stale store.
LAUNCHERS = ("dlrover-run", "torchrun", "torchrun-noshare")
DLROVER = f"dlrover-{anchors.DLROVER_VERSION}"  # the reference system, from .anchors/
NORMAL_PRIORITY = "dlrover-run-normal"  # spares at normal CPU priority (--spare-priority)
_SPARES = re.compile(r"(\d+) spare worker\(s\) ready")


class Launcher:
    """One launcher run in the background, with the script's milestones in an events file."""

    def __init__(
        self, name: str, workdir: str, nproc: int, restarts: int, args: list[str], run: int
    ) -> None:
        self.name, self.nproc = name, nproc
        self.events = os.path.join(workdir, f"{name}.{run}.events.jsonl")
        if os.path.exists(self.events):
            raise RuntimeError(f"{self.events} exists: every launcher run needs its own")
        self._seen: list[dict] = []
        self._offset = 0
        self.log = os.path.join(workdir, f"{name}.{run}.log")
        ours = name.startswith("dlrover-run")
        exe = os.path.join(BIN, "dlrover-run" if ours else "torchrun")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        if name == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        flags = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts)]
        flags += ["--monitor-interval", "0.1"]
        if name == NORMAL_PRIORITY:
            flags += ["--spare-priority", "normal"]
        self.master: anchors.DLRoverMaster | None = None
        if name == DLROVER:
            self.master = anchors.DLRoverMaster(f"bench{run}", self.log)
            env["DLROVER_MASTER_ADDR"] = self.master.addr
            exe = anchors.bin_path("dlrover-run")
            flags = ["--nnodes", "1", "--nproc_per_node", str(nproc)]
            flags += ["--max_restarts", str(restarts), "--monitor_interval", "0.1"]
        script = [SCRIPT, "--steps", "1000000", "--events", self.events]
        script += ["--ckpt-dir", os.path.join(workdir, f"{name}.ckpt"), *args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [exe, *flags, *script],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )

    def read(self) -> list[dict]:
        """Every milestone so far (read incrementally: the file grows by a line per step)."""
        if not os.path.exists(self.events):
            return self._seen
        with open(self.events, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written stays for the next read
        self._offset += end
        for line in data[:end].splitlines():
            try:
                self._seen.append(json.loads(line))
            except ValueError:
                pass
        return self._seen

    def spares_ready(self) -> int:
        with open(self.log, errors="replace") as f:
            found = _SPARES.findall(f.read())
        return int(found[-1]) if found else 0

    def group(self, restart: int, event: str) -> list[dict]:
        return [e for e in self.read() if e["event"] == event and e["restart"] == restart]

    def stop(self) -> None:
        """SIGTERM (the launcher stops its workers), then SIGKILL whatever is left: torchrun's
        workers live in sessions of their own, so killing the launcher's session is not enough."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in {e["pid"] for e in self.read() if e["event"] == "start"}:
            if self._is_our_worker(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        if self.master is not None:
            self.master.stop()

    def _is_our_worker(self, pid: int) -> bool:
        """Whether pid still runs this launcher's script (pids get reused)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return self.events.encode() in f.read()
        except OSError:
            return False


def wait(cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(POLL_SECONDS)
    return None


def wait_group(launcher: Launcher, restart: int, event: str, timeout: float) -> int | None:
    """The first attempt >= `restart` whose ranks all logged `event` within timeout (a launcher
    may spend further restarts on the way), or None."""

    def done() -> int | None:
        attempts = {e["restart"] for e in launcher.read() if e["event"] == event}
        for attempt in sorted(a for a in attempts if a >= restart):
            if len({e["rank"] for e in launcher.group(attempt, event)}) == launcher.nproc:
                return attempt
        return None

    def finished() -> bool:
        # the launcher gave up (restarts spent), or the group is back
        return done() is not None or launcher.proc.poll() is not None

    wait(finished, timeout)
    return done()


def group_time(launcher: Launcher, restart: int, event: str) -> float:
    """When the last rank of attempt `restart` first logged `event`."""
    first: dict[int, float] = {}
    for e in launcher.group(restart, event):
        first[e["rank"]] = min(first.get(e["rank"], e["t"]), e["t"])
    return max(first.values())


def measure(name: str, workdir: str, trials: int, settle: float, timeout: float, args: list[str]):
    """Kill rank 1 `trials` times, each `settle` s after the group entered its loop; the
    per-kill figures and the number of kills after which training never resumed (hangs)."""
    nproc = 2
    results: list[dict] = []
    failed = 0
    launcher = None
    restart = 0
    runs = len([f for f in os.listdir(workdir) if f.startswith(f"{name}.")])  # earlier rounds
    try:
        while len(results) + failed < trials:
            if launcher is None:
                runs += 1
                launcher = Launcher(name, workdir, nproc, 3 * trials + 1, args, runs)
                restart = 0
                if wait_group(launcher, restart, "step", 180) is None:
                    raise RuntimeError(f"{name} did not start training; see {launcher.log}")
            entered = group_time(launcher, restart, "loop")
            time.sleep(max(0.0, entered + settle - time.time()))
            spares = launcher.spares_ready() if name.startswith("dlrover-run") else None
            victim = [e for e in launcher.group(restart, "loop") if e["rank"] == 1][0]
            t_kill = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            back = wait_group(launcher, restart + 1, "step", timeout)
            if back is None:
                failed += 1
                print(f"{name}: after kill: no step within {timeout}s (a hang); restarting it")
                launcher.stop()
                launcher = None
                continue
            extra = back - restart - 1  # restarts spent beyond the one for the kill
            restart = back
            figures = {
                f"{key}_s": round(group_time(launcher, restart, key) - t_kill, 3)
                for key in ("pg_ready", "loop", "step")
            }
            results.append({**figures, "extra_restarts": extra, "spares_ready_at_kill": spares})
            print(
                f"{name}: kill {len(results)}: process group ready {figures['pg_ready_s']:.3f}s, "
                f"loop {figures['loop_s']:.3f}s, stepping {figures['step_s']:.3f}s"
                + (f" ({extra} extra restart(s) on the way)" if extra else "")
                + (f" [{spares} spare(s) ready at the kill]" if spares is not None else "")
            )
    finally:
        if launcher is not None:
            launcher.stop()
    return results, failed


def summary(results: list[dict], failed: int) -> dict:
    out: dict = {
        "kills": len(results) + failed,
        "not_recovered": failed,
        "extra_restarts": sum(r["extra_restarts"] for r in results),
    }
    for key in ("pg_ready_s", "loop_s", "step_s"):
        values = [r[key] for r in results]
        out[f"{key}_median"] = round(statistics.median(values), 3) if values else None
        out[f"{key}_min"] = round(min(values), 3) if values else None
        out[f"{key}_max"] = round(max(values), 3) if values else None
    out["runs"] = results
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="kills per launcher")
    p.add_argument(
        "--rounds", type=int, default=2, help="launchers take turns this many times (load drifts)"
    )
    p.add_argument("--settle", type=float, default=3.0, help="seconds of training before a kill")
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--hidden", type=int, default=256, help="MLP width of the example model")
    p.add_argument("--keep", action="store_true", help="keep the logs and events (printed path)")
    p.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS) + "," + DLROVER,
        help=f"comma separated; also {NORMAL_PRIORITY} (dlrover-run --spare-priority normal)",
    )
    args = p.parse_args()
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="torch_recovery_")
    print(f"work dir: {workdir}")
    names = [n for n in args.launchers.split(",") if n]
    notes = []
    if DLROVER in names and anchors.python() is None:
        names.remove(DLROVER)
        notes.append(anchors.MISSING)
        print(anchors.MISSING)
    script_args = ["--step-seconds", str(args.step_seconds), "--hidden", str(args.hidden)]
    runs: dict[str, list] = {n: [] for n in names}
    hangs: dict[str, int] = dict.fromkeys(names, 0)
    per_round = [
        args.trials // args.rounds + (i < args.trials % args.rounds) for i in range(args.rounds)
    ]
    try:
        for trials in per_round:
            for name in names:
                res, failed = measure(
                    name, workdir, trials, args.settle, args.trial_timeout, script_args
                )
                runs[name] += res
                hangs[name] += failed
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    figures = {n: summary(runs[n], hangs[n]) for n in names}
    d = figures["dlrover-run"]

    def ratio(base: str, key: str) -> float | None:
        """dlrover-run's figure as a fraction of `base`'s (lower is better)."""
        b = figures.get(base, {})
        if d.get(key) and b.get(key):
            return round(d[key] / b[key], 2)
        return None

    out = {
        "benchmark": "torch_recovery",
        "nproc": 2,
        "settle_s": args.settle,
        "launchers": figures,
        "step_ratio_vs_torchrun": ratio("torchrun", "step_s_median"),
        "step_ratio_vs_torchrun_noshare": ratio("torchrun-noshare", "step_s_median"),
        "step_ratio_vs_dlrover": ratio(DLROVER, "step_s_median"),
        "normal_priority_step_ratio_vs_torchrun_noshare": (
            round(
                figures[NORMAL_PRIORITY]["step_s_median"]
                / figures["torchrun-noshare"]["step_s_median"],
                2,
            )
            if NORMAL_PRIORITY in figures and "torchrun-noshare" in figures
            else None
        ),
        "pg_ready_ratio_vs_torchrun_noshare": ratio("torchrun-noshare", "pg_ready_s_median"),
        "targets": {
            "pg_ready_median_le_0.3s": bool(
                d["pg_ready_s_median"] is not None and d["pg_ready_s_median"] <= 0.3
            ),
            "step_le_0.6x_torchrun": all(
                r is not None and r <= 0.6
                for r in (
                    ratio("torchrun", "step_s_median"),
                    ratio("torchrun-noshare", "step_s_median"),
                )
            ),
            "no_hangs": d["not_recovered"] == 0,
        },
        "notes": notes,
        # load averages (1, 5, 15 min), 2 cores here: figures taken under load are slower.
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
