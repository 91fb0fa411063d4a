"""Torch worker recovery: dlrover-run against torchrun on the same DDP script, same run.

Each launcher runs ``examples/torch/train.py`` (2 processes, gloo on CPU, DDP, checkpoints with
torch.save) with ``--standalone``. Once training runs, the benchmark SIGKILLs the rank-1 worker and
measures, from the kill:

- ``pg_ready``: until every rank of the new group has returned from ``init_process_group``
  (detection, stop, rendezvous, process start; the launcher's own share, target <= 0.3 s);
- ``loop``: until every rank is back in its training loop (adds the script rebuilding its
  model and DDP and loading the checkpoint).

Every launcher gets ``--trials`` kills in one run (a restart each). Before each kill it waits
``--settle`` seconds of training, and for dlrover-run also until its spare workers are ready. A
launcher may spend further restarts before its group is back (torchrun's restarted workers can
fail with ``Gloo connectFullMesh failed ... Connection refused`` to the old group's address):
those count as ``extra_restarts`` and the time runs on. A kill after which no group is back in
the loop within ``--trial-timeout`` counts as not recovered, and the launcher is started again.
torchrun runs twice: as users run it (c10d rendezvous, its store shared with the workers) and
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "torch", "train.py")
BIN = os.path.dirname(sys.executable)
POLL_SECONDS = 0.02
# torchrun as users run it, and with the workaround that keeps it from reusing a stale store.
LAUNCHERS = ("dlrover-run", "torchrun", "torchrun-noshare")
_SPARES = re.compile(r"(\d+) spare worker\(s\) ready")


class Launcher:
    """One launcher run in the background, with the script's milestones in an events file."""

    def __init__(
        self, name: str, workdir: str, nproc: int, restarts: int, args: list[str], run: int
    ) -> None:
        self.name, self.nproc = name, nproc
        self.events = os.path.join(workdir, f"{name}.{run}.events.jsonl")
        self.log = os.path.join(workdir, f"{name}.{run}.log")
        exe = "dlrover-run" if name == "dlrover-run" else "torchrun"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        if name == "torchrun-noshare":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        flags = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts)]
        flags += ["--monitor-interval", "0.1"]
        script = [SCRIPT, "--steps", "1000000", "--events", self.events]
        script += ["--ckpt-dir", os.path.join(workdir, f"{name}.ckpt"), *args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [os.path.join(BIN, exe), *flags, *script],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )

    def read(self) -> list[dict]:
        if not os.path.exists(self.events):
            return []
        out = []
        with open(self.events) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

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


def wait_loop(launcher: Launcher, restart: int, timeout: float) -> int | None:
    """The first attempt >= `restart` whose ranks all entered the training loop within timeout
    (a launcher may spend further restarts on the way), or None."""

    def done() -> int | None:
        attempts = {e["restart"] for e in launcher.read() if e["event"] == "loop"}
        for attempt in sorted(a for a in attempts if a >= restart):
            if len(launcher.group(attempt, "loop")) == launcher.nproc:
                return attempt
        return None

    def finished() -> bool:
        # the launcher gave up (restarts spent), or the group is back
        return done() is not None or launcher.proc.poll() is not None

    wait(finished, timeout)
    return done()


def measure(name: str, workdir: str, trials: int, settle: float, timeout: float, args: list[str]):
    """Kill rank 1 `trials` times; the per-kill figures and the number of hung restarts."""
    nproc = 2
    results: list[dict] = []
    failed = 0
    launcher = None
    restart = 0
    runs = 0
    try:
        while len(results) + failed < trials:
            if launcher is None:
                runs += 1
                launcher = Launcher(name, workdir, nproc, 3 * trials + 1, args, runs)
                restart = 0
                if wait_loop(launcher, restart, 180) is None:
                    raise RuntimeError(f"{name} did not start training; see {launcher.log}")
            time.sleep(settle)
            if name == "dlrover-run":
                wait(lambda lch=launcher: lch.spares_ready() >= nproc, 120)
            victim = [e for e in launcher.group(restart, "loop") if e["rank"] == 1][0]
            t_kill = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            back = wait_loop(launcher, restart + 1, timeout)
            if back is None:
                failed += 1
                print(f"{name}: after kill: not back in the loop within {timeout}s")
                launcher.stop()
                launcher = None
                continue
            extra = back - restart - 1  # restarts spent beyond the one for the kill
            restart = back
            pg = max(e["t"] for e in launcher.group(restart, "pg_ready")) - t_kill
            loop = max(e["t"] for e in launcher.group(restart, "loop")) - t_kill
            results.append(
                {"pg_ready_s": round(pg, 3), "loop_s": round(loop, 3), "extra_restarts": extra}
            )
            print(
                f"{name}: kill {len(results)}: process group ready {pg:.3f}s, loop {loop:.3f}s"
                + (f" ({extra} extra restart(s) on the way)" if extra else "")
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
    for key in ("pg_ready_s", "loop_s"):
        values = [r[key] for r in results]
        out[f"{key}_median"] = round(statistics.median(values), 3) if values else None
        out[f"{key}_min"] = round(min(values), 3) if values else None
    out["runs"] = results
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5, help="kills per launcher")
    p.add_argument("--settle", type=float, default=4.0, help="seconds of training before a kill")
    p.add_argument("--trial-timeout", type=float, default=60.0)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--hidden", type=int, default=256, help="MLP width of the example model")
    p.add_argument("--keep", action="store_true", help="keep the logs and events (printed path)")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="torch_recovery_")
    print(f"work dir: {workdir}")
    script_args = ["--step-seconds", str(args.step_seconds), "--hidden", str(args.hidden)]
    try:
        figures = {}
        for name in LAUNCHERS:
            res, failed = measure(
                name, workdir, args.trials, args.settle, args.trial_timeout, script_args
            )
            figures[name] = summary(res, failed)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    d = figures["dlrover-run"]

    def ratio(base: str, key: str) -> float | None:
        b = figures[base]
        if d.get(key) and b.get(key):
            return round(b[key] / d[key], 2)
        return None

    out = {
        "benchmark": "torch_recovery",
        "nproc": 2,
        "dlrover_run": d,
        "torchrun": figures["torchrun"],
        "torchrun_noshare": figures["torchrun-noshare"],
        "speedup_pg_ready_vs_torchrun": ratio("torchrun", "pg_ready_s_median"),
        "speedup_loop_vs_torchrun": ratio("torchrun", "loop_s_median"),
        "speedup_pg_ready_vs_noshare": ratio("torchrun-noshare", "pg_ready_s_median"),
        "speedup_loop_vs_noshare": ratio("torchrun-noshare", "loop_s_median"),
        "target_pg_ready_met": bool(d["pg_ready_s_median"] and d["pg_ready_s_median"] <= 0.3),
        # 1-minute load average (2 cores here): figures taken under load are slower.
        "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
