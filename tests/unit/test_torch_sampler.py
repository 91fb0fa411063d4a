"""ElasticDistributedSampler: DistributedSampler's split, a position that counts what the loop
trained on, restores at another world size, bad states, and torchdata's StatefulDataLoader."""

from __future__ import annotations

import io
import itertools

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from dlrover_torch.data import ElasticDistributedSampler  # noqa: E402


class Records(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def samplers(n, world, **kw):
    return [ElasticDistributedSampler(Records(n), world, r, **kw) for r in range(world)]


def run_steps(group, batch, steps):
    """`steps` lockstep steps of `batch` records on every rank: the records trained."""
    iters = [iter(s) for s in group]
    trained = []
    for _ in range(steps):
        for s, it in zip(group, iters, strict=True):
            taken = list(itertools.islice(it, batch))
            s.advance(len(taken))
            trained += taken
    return trained


def run_epoch(group, batch):
    """Every rank to the end of its pass, in lockstep."""
    trained = []
    for s in group:
        taken = list(iter(s))
        s.advance(len(taken))
        trained += taken
    return trained


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n, world", [(100, 4), (101, 4), (7, 3), (3, 5)])
def test_a_fresh_epoch_splits_as_distributed_sampler(n, world, shuffle, drop_last):
    for rank in range(world):
        theirs = DistributedSampler(Records(n), world, rank, shuffle, 5, drop_last)
        ours = ElasticDistributedSampler(Records(n), world, rank, shuffle, 5, drop_last)
        for epoch in (0, 3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize(
    "n, before, after, batch, steps",
    [(120, 2, 1, 4, 5), (120, 1, 2, 4, 7), (120, 4, 3, 5, 3), (120, 3, 4, 2, 11), (96, 2, 2, 8, 1)],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_restore_at_another_world_size_trains_the_rest_of_the_epoch_once(
    n, before, after, batch, steps, shuffle
):
    first = samplers(n, before, shuffle=shuffle, seed=7)
    for s in first:
        s.set_epoch(2)
    trained = run_steps(first, batch, steps)
    states = {repr(s.state_dict()) for s in first}
    assert len(states) == 1  # every rank saves the same position
    state = torch.load(io.BytesIO(_saved(first[0].state_dict())), weights_only=True)
    assert state["position"] == before * batch * steps
    second = samplers(n, after, shuffle=shuffle, seed=7)
    for s in second:
        s.load_state_dict(state)
        s.set_epoch(2)  # the loaded epoch keeps its position
    trained += run_epoch(second, batch)
    counts = torch.bincount(torch.tensor(trained), minlength=n)
    # Every record once, but the padding of the last pass (DistributedSampler's rule).
    padding = len(trained) - n
    assert counts.min() == 1 and padding < after and counts.sum() == n + padding
    assert all(s.state_dict()["position"] == n for s in second)


def _saved(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_the_position_counts_what_the_loop_trained_not_what_the_loader_prefetched():
    sampler = ElasticDistributedSampler(Records(200), 2, 0, shuffle=True)
    loader = DataLoader(Records(200), batch_size=10, sampler=sampler, num_workers=2)
    seen = []
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        sampler.advance(len(batch))
        if i == 2:
            break
    assert sampler.state_dict()["position"] == 60  # 3 steps x 10 records x 2 ranks
    again = ElasticDistributedSampler(Records(200), 2, 0, shuffle=True)
    again.load_state_dict(sampler.state_dict())
    rest = list(again)
    assert not set(rest) & set(seen) and len(rest) + len(seen) == 100


def test_an_epoch_loaded_at_its_end_yields_nothing_then_the_next_epoch_starts_over():
    s = ElasticDistributedSampler(Records(10), 1, 0, shuffle=False)
    s.load_state_dict({**s.state_dict(), "epoch": 4, "position": 10})
    s.set_epoch(4)
    assert list(s) == []
    s.set_epoch(5)
    assert list(s) == list(range(10))


def test_without_set_epoch_each_pass_after_a_full_one_starts_from_the_front():
    s = ElasticDistributedSampler(Records(8), 2, 1, shuffle=True, seed=1)
    first = list(s)
    s.advance(len(first))
    assert list(s) == first  # the same epoch again, as DistributedSampler without set_epoch


def test_an_interrupted_pass_goes_on_from_what_was_trained():
    s = ElasticDistributedSampler(Records(20), 1, 0, shuffle=False)
    it = iter(s)
    taken = [next(it) for _ in range(5)]
    s.advance(3)
    assert taken == [0, 1, 2, 3, 4] and list(s) == list(range(3, 20))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"dataset_size": 99}, "dataset_size=99"),
        ({"seed": 1}, "seed=1"),
        ({"shuffle": False}, "shuffle=False"),
    ],
)
def test_a_state_saved_for_another_order_is_refused_naming_the_difference(change, named):
    s = ElasticDistributedSampler(Records(100), 2, 0, shuffle=True, seed=0)
    state = {**s.state_dict(), **change}
    with pytest.raises(ValueError, match=named) as e:
        s.load_state_dict(state)
    assert "(this sampler:" in str(e.value) and "start the epoch over" in str(e.value)


def test_other_bad_states_are_refused():
    s = ElasticDistributedSampler(Records(10), 1, 0)
    with pytest.raises(ValueError, match="not an ElasticDistributedSampler state"):
        s.load_state_dict({"yielded": 3})
    with pytest.raises(ValueError, match="outside"):
        s.load_state_dict({**s.state_dict(), "position": 11})
    with pytest.raises(ValueError, match="advance"):
        s.advance(-1)


def test_no_process_group_and_no_world_is_a_clear_error():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ElasticDistributedSampler(Records(10))
    with pytest.raises(ValueError, match="rank 2"):
        ElasticDistributedSampler(Records(10), 2, 2)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_carries_the_position_in_its_own_state(workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    n, batch = 120, 6

    def loader(world, rank):
        sampler = ElasticDistributedSampler(Records(n), world, rank, seed=3)
        kw = {"multiprocessing_context": "fork"} if workers else {}
        return sampler, sdl.StatefulDataLoader(
            Records(n), batch_size=batch, sampler=sampler, num_workers=workers, **kw
        )

    trained, states = [], []
    for rank in range(2):
        _, dl = loader(2, rank)
        for i, b in enumerate(dl):  # no advance(): the loader knows what it handed out
            trained += b.tolist()
            if i == 3:
                break
        states.append(dl.state_dict())
    assert len(trained) == 2 * 4 * batch
    # Go on at world size 1 from rank 0's loader state.
    sampler, dl = loader(1, 0)
    dl.load_state_dict(states[0])
    rest = [x for b in dl for x in b.tolist()]
    assert sorted(trained + rest) == list(range(n))
    assert sampler.epoch == 0
