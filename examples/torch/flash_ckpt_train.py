"""DDP training with flash checkpoint: a memory save every step, a disk save every N steps.

    dlrover-run --standalone --nproc-per-node 2 examples/torch/flash_ckpt_train.py --ckpt-dir CK
    python examples/torch/flash_ckpt_train.py --ckpt-dir CK        # no agent: standalone mode

``--kill-at-step K`` SIGKILLs rank ``--fault-rank`` right after its save of step K on the first
attempt; the restarted group resumes from the memory copy. Milestones go to ``--events``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrover_torch.checkpoint import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--disk-every", type=int, default=10)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--events", default="")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def event(name: str, **fields: object) -> None:
        if args.events:
            with open(args.events, "a") as fh:
                fh.write(json.dumps({"event": name, "rank": rank, "restart": restart, **fields}))
                fh.write("\n")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    ckpt = Checkpointer(args.ckpt_dir, keep_latest=3)
    start = 1
    restored = ckpt.load()
    if restored is not None:
        step, state = restored
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = step + 1
        event("restored", step=step, source=ckpt.last_load_source)

    for step in range(start, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # the data of this step
        x = torch.randn(16, 32, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {
            "model": net.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if step == start:  # the optimizer state exists now: reserve shm for the whole state
            ckpt.prepare(state)
        ckpt.save(step, state, "disk" if step % args.disk_every == 0 else "memory")
        if step == args.kill_at_step and rank == args.fault_rank and restart == 0:
            event("killing", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt.wait()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
    event("done", step=args.steps, params=digest.hexdigest())
    ckpt.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
