"""A small DDP training script written for torchrun; runs unchanged under dlrover-run.

It trains an MLP on synthetic data with gloo on CPU, saves a checkpoint with torch.save every
``--ckpt-every`` steps (rank 0, atomically) and resumes from it after a restart. Under dlrover-run
it also reports each step for hang detection (optional: the import is guarded).

Failure rehearsal flags: ``--kill-at-step N --kill-rank R`` SIGKILLs rank R at step N on the first
attempt, ``--crash-every K`` kills rank R at every K-th step of every attempt up to
``--max-crashes``, and ``--hang-at-step N`` makes rank R sleep forever at step N (first attempt).
``--events FILE`` appends one JSON line per milestone (start, process group ready, loop entered,
step, done) with a wall-clock time, for tests and benchmarks.

    dlrover-run --standalone --nproc-per-node 2 --max-restarts 3 train.py --steps 200
    torchrun    --standalone --nproc-per-node 2 --max-restarts 3 train.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

try:
    from dlrover_torch.progress import StepReporter
except ImportError:  # plain torchrun without dlrover installed
    StepReporter = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra sleep per step")
    p.add_argument("--ckpt-dir", default=os.environ.get("DLROVER_MODEL_DIR", "./ckpt"))
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--events", default="", help="append JSON-line milestones to this file")
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--crash-every", type=int, default=0)
    p.add_argument("--max-crashes", type=int, default=0)
    p.add_argument("--hang-at-step", type=int, default=-1)
    return p.parse_args()


class Events:
    """Appends milestones as JSON lines (one write each, so ranks do not interleave)."""

    def __init__(self, path: str, rank: int, restart: int) -> None:
        self.path, self.rank, self.restart = path, rank, restart

    def __call__(self, event: str, t: float | None = None, **fields: object) -> None:
        if not self.path:
            return
        rec = {"event": event, "rank": self.rank, "restart": self.restart, "pid": os.getpid()}
        rec.update(fields)
        rec["t"] = time.time() if t is None else t
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)


def save_checkpoint(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(args.events, rank, restart)
    events("start", t=T_START, world=world)

    dist.init_process_group("gloo")
    events("pg_ready", world=world)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU()
    )
    model.append(nn.Linear(args.hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model)
    reporter = StepReporter.from_env() if StepReporter is not None else None
    gen = torch.Generator().manual_seed(1000 + rank)
    events("loop", step=start, world=world)

    for step in range(start, args.steps):
        x = torch.randn(args.batch_size, 64, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done = step + 1
        if reporter is not None:
            reporter.report(done)
        if rank == 0 and done % args.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, done)
        events("step", step=done, loss=round(loss.item(), 4), world=world)
        if rank == args.kill_rank:
            first = restart == 0
            if (first and done == args.kill_at_step) or (
                args.crash_every and done % args.crash_every == 0 and restart < args.max_crashes
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            if first and done == args.hang_at_step:
                events("hang", step=done)
                while True:
                    time.sleep(3600)
        if args.step_seconds:
            time.sleep(args.step_seconds)

    if rank == 0:
        save_checkpoint(ckpt, model, opt, args.steps)
    dist.barrier()
    events("done", step=args.steps, world=world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
