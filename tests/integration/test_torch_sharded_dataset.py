"""dlrover_torch's ShardedDataset against a live master: DataLoader workers taking distinct
shards, a killed worker (records trained twice bounded by the batches in flight, none missing),
a restore from a saved position, files, and data states through flash checkpoint."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlrover_torch.data import ElasticDistributedSampler, ShardedDataset  # noqa: E402

N, BATCH = 600, 10
FORK = {"num_workers": 2, "multiprocessing_context": "fork", "prefetch_factor": 2}
# A dead DataLoader worker fails the loop with one of these (which depends on the moment).
WORKER_DIED = (RuntimeError, ConnectionError, EOFError)
IN_FLIGHT = 2 * 2 + 1  # prefetch_factor x workers, and the batch the loop holds

pytestmark = pytest.mark.timeout(120)


class Records(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def make(harness, **kw):
    kw.setdefault("epochs", 2)
    kw.setdefault("shuffle", True)
    kw.setdefault("records_per_shard", 40)
    return ShardedDataset("ds", Records(), BATCH, client=harness.client(0), **kw)


def train(ds, loader, ids, kill_worker_at=0, save_at=0, saved=None):
    """Iterate as a training loop does, appending each step's ids to `ids` and the state saved
    at step `save_at` to `saved`. At step `kill_worker_at` a DataLoader worker is SIGKILLed:
    the DataLoader then fails the loop (from its SIGCHLD handler, which is let run here, where
    it interrupts nothing; in a real job the process ends there anyway)."""
    for step, batch in enumerate(loader, start=1):
        ids.append(batch.tolist())
        ds.step_done()
        if step == save_at:
            saved.update(ds.state_dict())
        if step == kill_worker_at:
            os.kill(loader.iterator._workers[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)


def counts(ids):
    flat = [i for batch in ids for i in batch]
    return np.bincount(np.asarray(flat, dtype=np.int64), minlength=N)


def test_two_workers_take_distinct_shards_and_train_every_record_once_per_epoch(harness):
    ds = make(harness)
    ids: list = []
    train(ds, ds.loader(**FORK), ids)
    assert np.array_equal(counts(ids), np.full(N, 2))
    assert all(len(b) == BATCH for b in ids)  # 40-record shards: batches stay whole
    stats = harness.job.sharding.stats()[0]
    assert stats.finished and stats.records_done == 2 * N
    ds.close()


def test_a_killed_worker_costs_at_most_the_batches_in_flight_and_skips_nothing(harness):
    first = make(harness)
    ids1: list = []
    with pytest.raises(WORKER_DIED):
        train(first, first.loader(**FORK), ids1, kill_worker_at=12)
    first.flush()  # what the dead process had on the wire reaches the master
    again = make(harness)  # the restarted process: the node's unfinished shards go back
    ids2: list = []
    train(again, again.loader(**FORK), ids2)
    total = counts(ids1) + counts(ids2)
    assert total.min() == 2  # none missing, in either epoch
    assert (total - 2).sum() <= IN_FLIGHT * BATCH, (total - 2).sum()
    again.close()
    first.close()


def test_a_restore_brings_the_data_back_to_the_saved_step(harness):
    first = make(harness)
    ids1: list = []
    saved: dict = {}
    with pytest.raises(WORKER_DIED):
        train(first, first.loader(**FORK), ids1, kill_worker_at=12, save_at=5, saved=saved)
    first.flush()
    assert saved["global_step"] == 5
    again = make(harness)
    again.load_state_dict(saved)  # the model restored at step 5: the data goes back with it
    ids2: list = []
    train(again, again.loader(**FORK), ids2)
    # What attempt 1 trained after its snapshot is dropped with its model: exactly once.
    assert np.array_equal(counts(ids1[:5]) + counts(ids2), np.full(N, 2))
    again.close()
    first.close()


def test_a_state_of_another_dataset_is_refused(harness):
    ds = make(harness)
    state = ds.state_dict()
    with pytest.raises(ValueError, match=r"size=601 \(here: 600\)"):
        ds.load_state_dict({**state, "size": 601})
    ds.close()


def test_text_files_read_by_workers_train_every_line_once_per_epoch(harness, tmp_path):
    for f in range(4):
        lines = "".join(f"{i}\n" for i in range(f * 150, (f + 1) * 150))
        (tmp_path / f"part-{f}.txt").write_text(lines)
    ds = ShardedDataset.from_files(
        "text",
        str(tmp_path / "*.txt"),
        "text",
        BATCH,
        epochs=2,
        shuffle=True,
        seed=1,
        block=64,
        records_per_shard=50,
        parse_fn=lambda lines: torch.tensor([int(x) for x in lines]),
        client=harness.client(1),
    )
    assert ds.size == N
    ids: list = []
    train(ds, ds.loader(**FORK), ids)
    flat = [i for b in ids for i in b]
    assert np.array_equal(counts(ids), np.full(N, 2))
    assert flat[:N] != sorted(flat[:N])  # shuffled
    ds.close()


def test_data_states_survive_flash_checkpoint_and_torch_save(harness, tmp_path):
    from dlrover_torch.checkpoint import Checkpointer

    ds = make(harness)
    sampler = ElasticDistributedSampler(Records(), 2, 1, seed=4)
    sampler.set_epoch(3)
    sampler.advance(30)
    state = {"data": ds.state_dict(), "sampler": sampler.state_dict()}
    torch.save(state, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True) == state
    ckpt = Checkpointer(str(tmp_path / "flash"))
    try:
        ckpt.save(7, state, storage="disk")
        ckpt.wait()
        step, loaded = ckpt.load()
    finally:
        ckpt.close()
    assert step == 7 and loaded == state
    again = ElasticDistributedSampler(Records(), 1, 0, seed=4)
    again.load_state_dict(loaded["sampler"])
    assert again.epoch == 3 and again.position() == 60
    ds.load_state_dict(loaded["data"])
    ds.close()


def test_spawned_workers_get_the_dataset_and_a_client_of_their_own(harness):
    ds = make(harness, epochs=1)
    ids: list = []
    train(ds, ds.loader(num_workers=2, multiprocessing_context="spawn"), ids)
    assert np.array_equal(counts(ids), np.ones(N, dtype=np.int64))
    ds.close()


def test_only_a_nodes_first_local_rank_gives_its_shards_back(harness, monkeypatch):
    leader = make(harness, epochs=1)
    held = iter(leader.loader())
    next(held)  # holds a shard now, one batch of it trained
    leader.step_done()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    other = make(harness, epochs=1)  # the node's second local rank: the same holder
    next(iter(other.loader()))
    assert harness.job.sharding.stats()[0].records_doing > 0
    led = harness.job.sharding._entry("ds").ledger
    # The leader's shard is still held: its next report is applied, not stale.
    held_ids = {s.shard_id for s in led.held_by(harness.nodes[0].id)}
    assert len(held_ids) == 2
    other.close()
    leader.close()


def test_a_step_the_master_has_no_snapshot_for_is_a_clear_error(harness):
    from master.client import MasterError

    ds = make(harness)
    state = {"dataset": "ds", "global_step": 3, "size": N, "shuffle": True, "seed": 0}
    with pytest.raises(MasterError, match="cannot bring dataset .ds. back to step 3.*another job"):
        ds.load_state_dict(state)
    ds.close()
