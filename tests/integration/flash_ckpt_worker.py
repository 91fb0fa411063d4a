"""A training process for the flash-checkpoint tests (run with python -m).

Modes: ``save-hang DIR STEP`` (memory save, reference to DIR/ref.pt, then wait to be killed),
``load DIR`` (load and compare with DIR/ref.pt), ``ddp DIR RANK`` and ``fsdp DIR RANK`` (two
ranks over gloo).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

from dlrover_torch.checkpoint import Checkpointer, ShardedCheckpointer
from tests.unit.ckpt_helpers import assert_same, training_state


def save_hang(directory: str, step: int) -> None:
    state = training_state(seed=step)
    ck = Checkpointer(os.path.join(directory, "ckpt"))
    ck.save(step, state, "memory")
    torch.save(state, os.path.join(directory, "ref.pt"))
    print("saved", flush=True)
    time.sleep(3600)


def load(directory: str) -> None:
    ck = Checkpointer(os.path.join(directory, "ckpt"))
    found = ck.load()
    ref = torch.load(os.path.join(directory, "ref.pt"), weights_only=False)
    assert found is not None, "nothing loaded"
    assert_same(ref, found[1])
    print(json.dumps({"step": found[0]}), flush=True)
    ck.close(remove_memory=False)


def _init(directory: str, rank: int) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{directory}/pg", rank=rank, world_size=2
    )


def ddp(directory: str, rank: int) -> None:
    _init(directory, rank)
    ck = Checkpointer(os.path.join(directory, "ckpt"), writers="all")
    ck.save(2, training_state(seed=10 * rank + 2), "disk")
    ck.wait()
    ck.save(3, training_state(seed=10 * rank + 3), "memory")
    if rank == 1:
        ck.save(4, training_state(seed=10 * rank + 4), "memory")
    step, state = ck.load()  # memory steps disagree (3 vs 4): both ranks take disk step 2
    assert step == 2, step
    assert_same(training_state(seed=10 * rank + 2), state)
    if rank == 0:
        ck.save(4, training_state(seed=10 * rank + 4), "memory")
    step, state = ck.load()  # now both hold 4 in memory
    assert step == 4, step
    assert_same(training_state(seed=10 * rank + 4), state)
    ck.close()
    torch.distributed.destroy_process_group()
    print(json.dumps({"rank": rank, "ok": True}), flush=True)


def fsdp(directory: str, rank: int) -> None:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _init(directory, rank)
    mesh = init_device_mesh("cpu", (2,))

    def state(fill: float) -> dict:
        torch.manual_seed(0)
        full = torch.randn(6, 4) + fill
        return {
            "model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.full((3,), fill)},
            "optim": {"step": 7, "lr": 0.25, "m": distribute_tensor(full * 2, mesh, [Shard(0)])},
        }

    root = os.path.join(directory, "ckpt")
    ck = ShardedCheckpointer(root)
    ck.save(1, state(1.0), "disk")
    ck.wait()
    target = state(0.0)
    step, _ = ck.load(target)  # from memory: both ranks hold step 1
    assert step == 1
    for key in ("w",):
        assert torch.equal(
            target["model"][key].full_tensor(), state(1.0)["model"][key].full_tensor()
        )
    ck.close()  # memory gone: the next load must come from disk, through torch DCP
    fresh = state(0.0)
    ck2 = ShardedCheckpointer(root)
    step, _ = ck2.load(fresh)
    assert step == 1
    plain = state(0.0)
    dcp_load(plain, checkpoint_id=os.path.join(root, "step-1"))  # DCP alone reads our layout
    for got in (fresh, plain):
        want = state(1.0)
        assert torch.equal(got["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
        assert torch.equal(got["optim"]["m"].full_tensor(), want["optim"]["m"].full_tensor())
        assert torch.equal(got["model"]["b"], want["model"]["b"])
        assert got["optim"]["step"] == 7 and got["optim"]["lr"] == 0.25
    ck2.close()
    torch.distributed.destroy_process_group()
    print(json.dumps({"rank": rank, "ok": True}), flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "save-hang":
        save_hang(directory, int(sys.argv[3]))
    elif mode == "load":
        load(directory)
    elif mode == "ddp":
        ddp(directory, int(sys.argv[3]))
    elif mode == "fsdp":
        fsdp(directory, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
