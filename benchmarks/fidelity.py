"""Training fidelity: does a job that went through failures and elasticity train as well?

Runs the TF example (1 PS, chief, 2 workers) fault-free with three shuffle/initialisation
seeds, then once more (with the first seed) through, in this order:

- a worker scale-up, 2 -> 3 workers (`dlrover scale worker=3`) at 10% of the records;
- a PS migration to more memory (`dlrover migrate ps-0 --memory-mb 2048`) at 30%;
- a PS SIGKILL (`--kill ps:0@55%`): the data rolls back with the restored checkpoint.

It compares the chief's final evaluation loss (the same evaluation records every run) with
the spread of the fault-free runs, and prints the faulted run's distance from the fault-free
run of the same seed beside the seed-to-seed spread. Ends with one JSON line.

    python benchmarks/fidelity.py [--records 160000] [--seeds 0,1,2] [--report PREFIX]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

import yaml
from ps_recovery import Job, write_job

_FINAL_LOSS = re.compile(r"final eval \[chief:0\]: global_step=(\d+) loss=([\d.]+) auc=([\d.]+)")
SCALE_AT, MIGRATE_AT, PS_KILL_AT = 0.10, 0.30, 0.55


def _job_with_seed(workdir: str, records: int, seed: int) -> str:
    path = write_job(workdir, records)
    with open(path) as f:
        job = yaml.safe_load(f)
    job["command"] += ["--seed", str(seed)]
    job["name"] = f"fidelity-seed{seed}"
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _final_eval(run_dir: str) -> tuple[int, float, float]:
    """(global step, loss, auc) of the chief's final evaluation, from its last incarnation."""
    logs = glob.glob(os.path.join(run_dir, "logs", "chief-0.*.log"))
    for path in sorted(logs, key=lambda p: int(p.rsplit(".", 2)[1]), reverse=True):
        with open(path) as f:
            found = _FINAL_LOSS.findall(f.read())
        if found:
            step, loss, auc = found[-1]
            return int(step), float(loss), float(auc)
    raise RuntimeError(f"no final evaluation in the chief's logs under {run_dir}")


def _wait_fraction(job: Job, fraction: float, total: int) -> None:
    while True:
        s = job.status()
        if s is None:
            raise RuntimeError("the job ended before the event could be applied")
        if s[1] >= fraction * total:
            return
        time.sleep(0.2)


def run(workdir: str, records: int, seed: int, faults: bool) -> dict:
    name = f"seed{seed}" + ("-faulted" if faults else "")
    job_dir = os.path.join(workdir, name)
    os.makedirs(job_dir)
    job_yaml = _job_with_seed(job_dir, records, seed)
    run_dir = os.path.join(job_dir, "run")
    extra = ("--kill", f"ps:0@{PS_KILL_AT:.0%}") if faults else ()
    started = time.monotonic()
    job = Job(job_yaml, run_dir, *extra)
    events: list[str] = []
    if faults:
        total = 2 * records  # the example job trains 2 epochs
        _wait_fraction(job, SCALE_AT, total)
        reply = job.client.scale("worker", 3, reason="fidelity")
        events.append(f"workers {reply.previous} -> {reply.replicas}")
        _wait_fraction(job, MIGRATE_AT, total)
        moved = job.client.migrate("ps", 0, memory_mb=2048, reason="fidelity")
        events.append(f"ps-0 migrated at checkpoint step {moved.checkpoint_step}")
    summary = job.finish()
    wall = time.monotonic() - started
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{name}: the job {summary['status']}: {summary['reason']}")
    step, loss, auc = _final_eval(run_dir)
    kinds = [e["kind"] for e in summary["events"]]
    if faults:
        events.append(f"ps-0 SIGKILLed ({kinds.count('rollback')} rollback events)")
        for kind in ("scale", "migrated", "fault"):
            if kind not in kinds:
                raise RuntimeError(f"{name}: no {kind!r} event: the run did not go as planned")
    data = summary["datasets"]["train"]
    return {
        "run": name,
        "seed": seed,
        "faults": events,
        "final_loss": loss,
        "final_auc": auc,
        "global_step": step,
        "records_done": data["records_done"],
        "records_redone": data["records_redone"],
        "wall_seconds": round(wall, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=160_000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--report", default="", help="also write PREFIX.json and PREFIX.txt")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = tempfile.mkdtemp(prefix="fidelity-")
    try:
        runs = [run(workdir, args.records, s, faults=False) for s in seeds]
        faulted = run(workdir, args.records, seeds[0], faults=True)
    except Exception:
        print(f"run dirs kept for a look: {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    losses = [r["final_loss"] for r in runs]
    low, high = min(losses), max(losses)
    same_seed = runs[0]["final_loss"]
    within = low <= faulted["final_loss"] <= high
    lines = [
        f"TF example, {args.records:,} records x 2 epochs, final evaluation loss (chief)",
        "",
        f"{'run':<14} {'loss':>7} {'auc':>7} {'step':>6} {'redone':>8} {'wall s':>7}  events",
    ]
    for r in [*runs, faulted]:
        lines.append(
            f"{r['run']:<14} {r['final_loss']:>7.4f} {r['final_auc']:>7.4f} "
            f"{r['global_step']:>6} {r['records_redone']:>8,} {r['wall_seconds']:>7}  "
            + "; ".join(r["faults"])
        )
    lines += [
        "",
        f"fault-free spread over seeds {seeds}: [{low:.4f}, {high:.4f}] (width {high - low:.4f})",
        f"faulted run: {faulted['final_loss']:.4f}, "
        f"{'within' if within else 'OUTSIDE'} the spread; "
        f"{faulted['final_loss'] - same_seed:+.4f} from the fault-free run of the same seed",
    ]
    text = "\n".join(lines)
    print(text)
    result = {
        "benchmark": "fidelity",
        "records": args.records,
        "fault_free": runs,
        "faulted": faulted,
        "spread": [low, high],
        "within_spread": within,
        "delta_same_seed": round(faulted["final_loss"] - same_seed, 4),
    }
    if args.report:
        command = "python benchmarks/fidelity.py " + " ".join(sys.argv[1:])
        with open(args.report + ".txt", "w") as f:
            f.write(f"$ {command}\n\n{text}\n")
        with open(args.report + ".json", "w") as f:
            json.dump({"command": command, **result}, f, indent=1)
    print(json.dumps(result))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
