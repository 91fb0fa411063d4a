"""A light torchrun-style script for dlrover-run tests: gloo all-reduce steps, torch.save resume.

Each step all-reduces a counter across ranks; rank 0 checkpoints the step with torch.save and
every rank resumes from it. Milestones go to --events as JSON lines. Fault knobs: --kill-at-step
(SIGKILL rank --fault-rank on the first attempt), --crash-every/--max-crashes (SIGKILL on every
K-th step while the restart count is below M), --hang-at-step (sleep forever, first attempt),
--exit-at-step (sys.exit(3), first attempt), --raise-at-step (an uncaught RuntimeError, first
attempt; ``main`` is wrapped in torch's ``@record``, so it lands in the worker's error file).
--no-report keeps the script silent to dlrover's step API so hangs must be found from CPU
activity.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
)


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--exit-at-step", type=int, default=-1)
    p.add_argument("--raise-at-step", type=int, default=-1)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--crash-every", type=int, default=0)
    p.add_argument("--max-crashes", type=int, default=0)
    p.add_argument("--no-report", action="store_true")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    def event(name: str, **fields: object) -> None:
        rec = {"event": name, "rank": rank, "world": world, "restart": restart, "pid": os.getpid()}
        rec.update(fields, t=time.time())
        fd = os.open(args.events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, (json.dumps(rec) + "\n").encode())
        os.close(fd)

    event("start", env={k: os.environ.get(k) for k in ENV_NAMES}, argv=sys.argv[1:])
    print(f"script rank {rank} of {world} starting", flush=True)
    dist.init_process_group("gloo")
    start = torch.load(args.ckpt)["step"] if os.path.exists(args.ckpt) else 0
    reporter = None
    if not args.no_report:
        from dlrover_torch.progress import StepReporter

        reporter = StepReporter.from_env()
    event("loop", step=start)
    x = torch.zeros(1)
    for step in range(start + 1, args.steps + 1):
        x.fill_(1.0)
        dist.all_reduce(x)
        if int(x.item()) != world:
            raise RuntimeError(f"all-reduce gave {x.item()} with world size {world}")
        if rank == 0:
            tmp = f"{args.ckpt}.tmp"
            torch.save({"step": step}, tmp)
            os.replace(tmp, args.ckpt)
        if reporter is not None:
            reporter.report(step)
        event("step", step=step)
        if rank == args.fault_rank:
            first = restart == 0
            if (first and step == args.kill_at_step) or (
                args.crash_every and step % args.crash_every == 0 and restart < args.max_crashes
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            if first and step == args.exit_at_step:
                sys.exit(3)
            if first and step == args.raise_at_step:
                raise RuntimeError(f"raised at step {step}")
            if first and step == args.hang_at_step:
                event("hang", step=step)
                while True:
                    time.sleep(3600)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    dist.barrier()
    event("done", step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
