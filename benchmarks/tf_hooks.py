"""Records trained per second of wall time by the TF example job, with and without the dlrover
sharded input and hooks.

Runs examples/tf/job.yaml through `dlrover submit` alternately with `--input plain` (a plain
tf.data pipeline, each trainer reading its fixed 1/n of the records: the baseline) and
`--input dlrover` (ShardedDataset + ShardProgressHook), same cluster, same records. The
figure is what a user feels: the records the cluster trained divided by the wall time from the
first step of any task to the end of the last one (each task logs its training seconds at its
end, with a timestamp). The records are counted, not derived from steps: every trainer logs
the record ids of each step it trains (`--log-trained-ids`, in both modes), and each mode's
count is shown, so a mode cannot look faster by training fewer records. (It did: the job
keeps spare worker slots in TF_CONFIG for scaling up, and the plain input split the records
over every slot, so its runs trained 3/5 of them; here the job has no spare slot.) Per-task
rates alone would mislead: with fixed input splits fast workers finish early and sit idle
while the slowest one ends the job.

The standby PS (a spare PS process the master keeps with TensorFlow loaded, `ps_standby`, on by
default) is off in the two runs compared: it is not part of the input or the hooks, and the
master starts it once it sees training run, which it sees only through the progress hook, so
a plain-input job gets its standby a minute in, outside this short window. A third run, the
dlrover input with the standby on, shows its cost: one TensorFlow import (seconds of CPU) on
the job's machine during the first seconds of training, paid once per job and per promotion,
at idle priority (nice 19), so on a machine that trains it takes only idle CPU.

Each task's cost is its CPU ms per local step (its process's CPU time over its training
window): per-task steps/s differ between the modes by scheduling alone on a small machine
(with a fixed split the fast workers finish early and leave the cores to the chief; with
dynamic shards all train to the end). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import yaml
from common import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "tf")
TARGET_RATIO = 0.95
_TRAINED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*trained (\d+) local steps in ([\d.]+) s "
    r"from the first step[^\n]*?(?:; ([\d.]+) CPU s)?$",
    re.M,
)


def run_once(
    mode: str, records: int, epochs: int, workdir: str, graph_rewrites: bool, standby: bool = False
) -> dict:
    """One job in `mode`; returns per-task steps and seconds, and the cluster rate."""
    with open(os.path.join(EXAMPLE, "job.yaml")) as f:
        job = yaml.safe_load(f)
    command = [c for c in job["command"]]
    command[1] = os.path.join(EXAMPLE, "wide_deep.py")
    for flag, value in (("--input", mode), ("--records", str(records)), ("--epochs", str(epochs))):
        command[command.index(flag) + 1] = value
    run_dir = tempfile.mkdtemp(prefix=f"run-{mode}-", dir=workdir)
    ids_prefix = os.path.join(run_dir, "trained")
    command += ["--log-trained-ids", ids_prefix]
    if graph_rewrites:
        command.append("--graph-rewrites")
    job["command"] = command
    # No spare worker slots: the plain input splits the records over the trainers TF_CONFIG
    # lists, so slots without a process (the example reserves some for scaling up) would leave
    # their share untrained and the baseline would train fewer records than the data holds.
    job["worker"]["max_replicas"] = job["worker"]["replicas"]
    job["workdir"] = workdir
    job["name"] = f"bench-{mode}"
    job["ps_standby"] = standby
    spec_path = os.path.join(workdir, f"job-{mode}.yaml")
    with open(spec_path, "w") as f:
        yaml.safe_dump(job, f)
    proc = subprocess.run(
        [sys.executable, "-m", "master.cli", "master", spec_path, "--run-dir", run_dir],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({run_dir}):\n{proc.stderr[-3000:]}")
    tasks = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "logs", "*.log"))):
        name = os.path.basename(path)
        if name.startswith("ps-"):
            continue
        with open(path, errors="replace") as f:
            m = _TRAINED.search(f.read())
        if m:
            end = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            seconds = float(m.group(3))
            tasks[name] = {"steps": int(m.group(2)), "seconds": seconds, "start": end - seconds}
            tasks[name]["cpu_s"] = float(m.group(4)) if m.group(4) else None
            tasks[name]["end"] = end
    if not tasks:
        raise RuntimeError(f"no task reported its training time in {run_dir}/logs")
    first = min(t["start"] for t in tasks.values())
    window = max(t["end"] for t in tasks.values()) - first
    steps = sum(t["steps"] for t in tasks.values())
    trained = sum(os.path.getsize(p) // 8 for p in glob.glob(f"{ids_prefix}.*.ids"))
    return {
        "mode": mode,
        "standby_ready_s": _standby_ready(run_dir, first) if standby else None,
        "tasks": tasks,
        "records": trained,
        "records_per_s": trained / window,
        "steps": steps,
        "steps_per_s": steps / window,
        "window_s": window,
    }


def _standby_ready(run_dir: str, first_step: float) -> float | None:
    """Seconds from the first step until the standby PS said it was ready (None: never)."""
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e.get("kind") == "ps_standby" and e.get("reason") == "ready":
                return e["time"] - first_step
    return None


VARIANTS = (("plain", False), ("dlrover", False), ("dlrover", True))


def _cpu_per_step(task: dict) -> str:
    """ " (N CPU ms/step)": the process's CPU time over its training window, per local step."""
    if not task.get("cpu_s") or not task["steps"]:
        return ""
    return f" ({1000 * task['cpu_s'] / task['steps']:.0f} CPU ms/step)"


def _median_cpu_per_step(runs: list[dict]) -> dict[str, float]:
    """Each task's median CPU ms per local step over `runs` (task name without its id)."""
    per_task: dict[str, list[float]] = {}
    for r in runs:
        for name, t in r["tasks"].items():
            if t.get("cpu_s") and t["steps"]:
                per_task.setdefault(name.split(".")[0], []).append(1000 * t["cpu_s"] / t["steps"])
    return {k: round(statistics.median(v), 2) for k, v in sorted(per_task.items())}


def _label(mode: str, standby: bool) -> str:
    return f"{mode}+standby" if standby else mode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, alternating")
    p.add_argument("--records", type=int, default=160_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--graph-rewrites",
        action="store_true",
        help="keep Grappler on in the dlrover runs too (the example turns it off there, for "
        "faster session rebuilds after a PS failure; plain TF keeps it on)",
    )
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {_label(*v): [] for v in VARIANTS}
    load = []
    with tempfile.TemporaryDirectory(prefix="bench-tf-") as workdir:
        for i in range(args.repeats):
            for mode, standby in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                r = run_once(mode, args.records, args.epochs, workdir, args.graph_rewrites, standby)
                load.append(os.getloadavg()[0])
                runs[_label(mode, standby)].append(r)
                if not args.json_only:
                    per_task = ", ".join(
                        f"{k.split('.')[0]} {v['steps'] / v['seconds']:.1f}{_cpu_per_step(v)}"
                        for k, v in r["tasks"].items()
                    )
                    ready = r["standby_ready_s"]
                    extra = "" if ready is None else f"; standby ready {ready:.1f} s in"
                    print(
                        f"{_label(mode, standby):15s} run {i + 1}: {r['records_per_s']:8.0f} "
                        f"records/s ({r['records']:,} records, {r['steps']} steps over "
                        f"{r['window_s']:.1f} s; steps/s per task: {per_task}; "
                        f"load {load[-1]:.1f}{extra})",
                        flush=True,
                    )
    median = {k: statistics.median(r["records_per_s"] for r in v) for k, v in runs.items()}
    plain, dlrover, with_standby = median["plain"], median["dlrover"], median["dlrover+standby"]
    ratio = dlrover / plain
    expected = args.records * args.epochs
    if not args.json_only:
        counted = {k: sorted({r["records"] for r in v}) for k, v in runs.items()}
        print(
            f"median records/s: plain {plain:.0f}, dlrover {dlrover:.0f}; ratio {ratio:.3f} "
            f"(target >= {TARGET_RATIO}); with the standby PS on: {with_standby:.0f}, "
            f"{with_standby / plain:.3f}x plain; records per run: {counted} "
            f"(the data: {expected:,})"
        )
    doc = {
        "benchmark": "tf_hooks",
        "records_expected": expected,
        **{f"{k}_records".replace("+", "_"): [r["records"] for r in v] for k, v in runs.items()},
        **{
            f"{k}_records_per_s".replace("+", "_"): [round(r["records_per_s"], 1) for r in v]
            for k, v in runs.items()
        },
        **{
            f"{k}_window_s".replace("+", "_"): [round(r["window_s"], 2) for r in v]
            for k, v in runs.items()
        },
        "standby_ready_s": [
            None if r["standby_ready_s"] is None else round(r["standby_ready_s"], 2)
            for r in runs["dlrover+standby"]
        ],
        "cpu_ms_per_step": {k.replace("+", "_"): _median_cpu_per_step(v) for k, v in runs.items()},
        "median_plain": round(plain, 1),
        "median_dlrover": round(dlrover, 1),
        "median_dlrover_standby": round(with_standby, 1),
        "ratio": round(ratio, 4),
        "ratio_with_standby": round(with_standby / plain, 4),
        "dlrover_grappler": "on" if args.graph_rewrites else "off",
        "target_met": ratio >= TARGET_RATIO,
        "loadavg": [round(x, 2) for x in load],
    }
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
