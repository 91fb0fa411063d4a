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
from dlrover_torch.script_main import exit_like_python
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
    """A real FSDP2 model + Adam on CPU: save, drift, restore from memory, then from disk."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(directory, rank)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "epoch": 3}

    def full(sd: dict) -> dict:
        out = {f"model.{k}": v.full_tensor().clone() for k, v in sd["model"].items()}
        for fqn, entry in sd["optim"]["state"].items():
            out[f"exp_avg.{fqn}"] = entry["exp_avg"].full_tensor().clone()
            out[f"step.{fqn}"] = entry["step"].clone()
        return out

    def check(restored: dict, want: dict) -> None:
        set_state_dict(
            model,
            opt,
            model_state_dict=restored["model"],
            optim_state_dict=restored["optim"],
        )
        got = full(state())
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
        assert restored["epoch"] == 3

    train()
    saved = state()
    want = full(saved)
    root = os.path.join(directory, "ckpt")
    ck = ShardedCheckpointer(root)
    ck.save(1, saved, "disk")
    ck.wait()
    train()  # drift away from the checkpoint
    step, restored = ck.load(state())
    assert step == 1 and ck.last_load_source == "memory"
    check(restored, want)
    ck.close()  # memory gone: the next load must come from disk, through torch DCP
    train()
    ck2 = ShardedCheckpointer(root)
    step, restored = ck2.load(state())
    assert step == 1 and ck2.last_load_source == "disk"
    check(restored, want)
    train()
    plain = state()
    dcp_load(plain, checkpoint_id=os.path.join(root, "step-1"))  # DCP alone reads our layout
    check(plain, want)
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
    # Ends as dlrover-run ends its workers, without CPython's teardown: a gloo thread can
    # abort it (SIGABRT after the work is done, seen under load; see dlrover_torch.script_main).
    error = None
    try:
        main()
    except BaseException as e:  # reported and turned into the exit code as CPython would
        error = e
    exit_like_python(error)
