"""A DDP job that trains from text files with ElasticDistributedSampler and a fixed global batch;
it resumes mid-epoch after a crash, also at another world size. Written for torchrun; runs
unchanged under dlrover-run.

Each line of the files is a record id; its features and label are computed from it (a fixed
linear model plus noise), so the files stay small. Rank 0 snapshots model, optimizer and
sampler every ``--ckpt-every`` optimizer steps (torch.save, atomically; or flash checkpoint
with ``--flash DIR``), and every rank resumes from the snapshot at start.

    python examples/torch/files_train.py --make-data /tmp/data --records 4096
    dlrover-run --standalone --nproc-per-node 2 --max-restarts 2 examples/torch/files_train.py \\
        --data '/tmp/data/*.txt' --ckpt /tmp/ck.pt --crash-at-step 20
    # elastic: dlrover-run --nnodes 1:2 ... shrinks and grows; the global batch stays the same

With ``--sharded`` (a job run by ``dlrover submit``, one rank) the records come from the
master's shards of the files instead (ShardedDataset.from_files, 2 DataLoader workers), and the
data position is saved and restored with the model; ``--kill-loader-worker-at-step N`` SIGKILLs
a DataLoader worker once.

``--ids-log FILE`` appends, after each optimizer step, the ids each rank trained on (JSON lines,
with the step, epoch and group) so tests can check that every record of an epoch is trained
exactly once; ``--loss-log FILE`` (rank 0) appends each step's mean loss.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from dlrover_torch.data import ElasticDistributedSampler, FixedGlobalBatch
from dlrover_torch.progress import StepReporter

FEATURES = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="", help="glob of text files, one record id per line")
    p.add_argument("--make-data", default="", help="write --records ids into 4 files here, exit")
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default="./ckpt.pt", help="the torch.save snapshot")
    p.add_argument("--flash", default="", help="snapshot with flash checkpoint into this dir")
    p.add_argument("--ckpt-every", type=int, default=5, help="optimizer steps between snapshots")
    p.add_argument("--crash-at-step", type=int, default=-1, help="once: SIGKILL --crash-rank")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra sleep per step")
    p.add_argument(
        "--sharded", action="store_true", help="the master's shards (dlrover submit), one rank"
    )
    p.add_argument(
        "--kill-loader-worker-at-step",
        type=int,
        default=-1,
        help="once: SIGKILL a DataLoader worker",
    )
    p.add_argument("--ids-log", default="")
    p.add_argument("--loss-log", default="")
    return p.parse_args()


def make_data(folder: str, records: int) -> None:
    os.makedirs(folder, exist_ok=True)
    per_file = -(-records // 4)
    for f in range(4):
        ids = range(f * per_file, min(records, (f + 1) * per_file))
        with open(os.path.join(folder, f"part-{f}.txt"), "w") as out:
            out.write("".join(f"{i}\n" for i in ids))


class IdLines(Dataset):
    """The record ids in the lines of some text files, as (id, features, label)."""

    def __init__(self, pattern: str) -> None:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise SystemExit(f"no file matches --data {pattern!r}")
        self.ids = [int(line) for p in paths for line in open(p) if line.strip()]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return example(self.ids[i])


W_TRUE = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(42))


def example(rid: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Record `rid`: its features and its label (a fixed linear model plus noise)."""
    x = torch.sin(torch.arange(1, FEATURES + 1, dtype=torch.float32) * (rid + 1) * 0.37)
    noise = 0.1 * torch.sin(torch.tensor([rid * 1.7]))
    return rid, x, (x @ W_TRUE + noise).squeeze(0)


def parse_lines(lines: list[bytes]):
    """A batch of text lines (record ids) from ShardedDataset.from_files as (ids, x, y)."""
    return torch.utils.data.default_collate([example(int(line)) for line in lines])


def append_json(path: str, record: dict) -> None:
    """One write per record, so ranks never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


class Snapshots:
    """The training state in one torch.save file (written atomically by rank 0), or in flash
    checkpoint when a directory is given."""

    def __init__(self, path: str, flash_dir: str) -> None:
        self.path = path
        self.flash = None
        if flash_dir:
            from dlrover_torch.checkpoint import Checkpointer

            self.flash = Checkpointer(flash_dir)

    def load(self) -> dict | None:
        if self.flash is not None:
            found = self.flash.load()
            return None if found is None else found[1]
        if not os.path.exists(self.path):
            return None
        return torch.load(self.path, weights_only=True)

    def save(self, step: int, state: dict, rank: int) -> None:
        if self.flash is not None:  # every rank: its memory copy; rank 0's is persisted
            self.flash.save(step, state, storage="disk")
            return
        if rank == 0:
            tmp = f"{self.path}.tmp.{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, self.path)

    def close(self) -> None:
        if self.flash is not None:
            self.flash.wait()
            self.flash.close()


def train_sharded(args: argparse.Namespace) -> None:
    """One rank reading the master's shards of the files with 2 DataLoader workers; the data
    position is saved with the model and restored with it."""
    from dlrover_torch.data import ShardedDataset

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    group = f"{os.environ.get('MASTER_PORT')}-{restart}"
    ds = ShardedDataset.from_files(
        "train",
        args.data,
        "text",
        args.micro_batch,
        epochs=args.epochs,
        shuffle=True,
        seed=args.seed,
        records_per_shard=4 * args.micro_batch,
        parse_fn=parse_lines,
    )
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    snapshots = Snapshots(args.ckpt, args.flash)
    step = 0
    state = snapshots.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        ds.load_state_dict(state["data"])  # the master's ledger goes back to that step
        step = state["step"]
    if args.ids_log:
        append_json(
            args.ids_log,
            {
                "event": "start",
                "rank": 0,
                "world": 1,
                "group": group,
                "step": step,
                "t": time.time(),
            },
        )
    marker = args.ckpt + ".killed"
    for ids, x, y in ds.loader(num_workers=2):
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        ds.step_done(step)
        if args.ids_log:
            append_json(
                args.ids_log,
                {
                    "event": "step",
                    "rank": 0,
                    "world": 1,
                    "group": group,
                    "step": step,
                    "epoch": -1,
                    "ids": ids.tolist(),
                },
            )
        if step % args.ckpt_every == 0:
            snapshot = {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "data": ds.state_dict(step),
                "step": step,
            }
            snapshots.save(step, snapshot, 0)
        if step == args.kill_loader_worker_at_step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    snapshots.close()
    ds.close()
    if args.ids_log:
        append_json(
            args.ids_log, {"event": "done", "rank": 0, "world": 1, "group": group, "step": step}
        )


def main() -> None:
    args = parse_args()
    if args.make_data:
        make_data(args.make_data, args.records)
        return
    if args.sharded:
        train_sharded(args)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = f"{os.environ.get('MASTER_PORT')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"

    data = IdLines(args.data)
    if len(data) % args.global_batch:
        raise SystemExit(f"{len(data)} records: make it a multiple of --global-batch")
    batch = FixedGlobalBatch(args.global_batch, args.micro_batch, world)
    sampler = ElasticDistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=1)
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    snapshots = Snapshots(args.ckpt, args.flash)
    step = 0
    state = snapshots.load()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.load_state_dict(state["sampler"])  # saved at any world size
        step = state["step"]
    ddp = DDP(model)
    reporter = StepReporter.from_env()  # dlrover-run's hang detection; inert under torchrun
    if args.ids_log:
        append_json(
            args.ids_log,
            {
                "event": "start",
                "rank": rank,
                "world": world,
                "group": group,
                "step": step,
                "t": time.time(),
            },
        )
    crash_marker = args.ckpt + ".crashed"

    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)  # the loaded epoch keeps its position
        trained: list[int] = []
        step_loss = torch.zeros(())
        for micro, (ids, x, y) in enumerate(loader):
            with batch.sync(ddp, micro):
                loss = nn.functional.mse_loss(ddp(x).squeeze(1), y) * batch.loss_scale
                loss.backward()
            step_loss += loss.detach()
            sampler.advance(len(ids))  # what this rank trained on, not what was prefetched
            trained += ids.tolist()
            if not batch.is_step_end(micro):
                continue
            opt.step()
            opt.zero_grad()
            step += 1
            reporter.report(step)
            if args.ids_log:
                append_json(
                    args.ids_log,
                    {
                        "event": "step",
                        "rank": rank,
                        "world": world,
                        "group": group,
                        "step": step,
                        "epoch": epoch,
                        "ids": trained,
                    },
                )
            trained = []
            if args.loss_log:
                dist.all_reduce(step_loss)
                if rank == 0:
                    append_json(args.loss_log, {"step": step, "loss": step_loss.item() / world})
            step_loss = torch.zeros(())
            if step % args.ckpt_every == 0:
                snapshot = {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "sampler": sampler.state_dict(),
                    "step": step,
                }
                snapshots.save(step, snapshot, rank)
            if step == args.crash_at_step and rank == args.crash_rank:
                if not os.path.exists(crash_marker):
                    open(crash_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            if args.step_seconds:
                time.sleep(args.step_seconds)
    snapshots.close()
    dist.barrier()
    if args.ids_log:
        append_json(
            args.ids_log,
            {"event": "done", "rank": rank, "world": world, "group": group, "step": step},
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
