"""What warming spare workers costs a training job: step time while they import, same run.

dlrover-run starts one spare per local rank as soon as a worker group starts, at low CPU
priority. This runs ``examples/torch/train.py`` CPU-bound (2 ranks on 2 cores, no sleep per
step) under dlrover-run with spares and with ``--no-spare-workers``, alternately, and compares
the step times of the first ``--seconds`` of training (when the spares import torch and the
script's imports). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT

SCRIPT = os.path.join(ROOT, "examples", "torch", "train.py")
RUN = os.path.join(os.path.dirname(sys.executable), "dlrover-run")


def read_events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def one_run(workdir: str, tag: str, spares: bool, seconds: float, hidden: int) -> dict:
    """Step times of rank 0 over the first `seconds` after the first step."""
    events = os.path.join(workdir, f"{tag}.jsonl")
    flags = ["--standalone", "--nproc-per-node", "2"]
    if not spares:
        flags.append("--no-spare-workers")
    script = [SCRIPT, "--steps", "10000000", "--hidden", str(hidden), "--events", events]
    script += ["--ckpt-dir", os.path.join(workdir, f"{tag}.ckpt"), "--ckpt-every", "1000000"]
    with open(os.path.join(workdir, f"{tag}.log"), "wb") as log:
        proc = subprocess.Popen(
            [RUN, *flags, *script],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        first = None
        while first is None and time.monotonic() < deadline:
            steps = [e for e in read_events(events) if e["event"] == "step" and e["rank"] == 0]
            first = steps[0]["t"] if steps else None
            time.sleep(0.1)
        if first is None:
            raise RuntimeError(f"{tag}: no training step; see {workdir}/{tag}.log")
        time.sleep(max(0.0, first + seconds + 0.5 - time.time()))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    times = [e["t"] for e in read_events(events) if e["event"] == "step" and e["rank"] == 0]
    window = [t for t in times if t <= times[0] + seconds]
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    return {
        "steps": len(window),
        "step_s_median": statistics.median(gaps),
        "step_s_mean": statistics.mean(gaps),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0, help="window after the first step")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width: CPU per step")
    p.add_argument("--pairs", type=int, default=3, help="runs with and without spares, in turn")
    args = p.parse_args()
    load0 = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="spare_cost_")
    runs: dict[str, list[dict]] = {"spares": [], "no_spares": []}
    try:
        for i in range(args.pairs):
            for name, spares in (("spares", True), ("no_spares", False)):
                r = one_run(workdir, f"{name}{i}", spares, args.seconds, args.hidden)
                runs[name].append(r)
                print(
                    f"{name} run {i + 1}: {r['steps']} steps in {args.seconds:.0f} s, "
                    f"median step {r['step_s_median'] * 1000:.1f} ms",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    cost = med("spares", "step_s_mean") / med("no_spares", "step_s_mean") - 1
    out = {
        "benchmark": "spare_cost",
        "window_s": args.seconds,
        "hidden": args.hidden,
        "runs": runs,
        "step_s_mean_with_spares": round(med("spares", "step_s_mean"), 5),
        "step_s_mean_without": round(med("no_spares", "step_s_mean"), 5),
        "slowdown_while_spares_warm": round(cost, 3),
        "load_avg_before": [round(x, 2) for x in load0],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
