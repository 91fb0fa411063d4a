"""FixedGlobalBatch: accumulation steps from the world size, a clear error where the global
batch cannot be kept, and the same gradient as one big batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dlrover_torch.data import FixedGlobalBatch, accumulation_steps  # noqa: E402


@pytest.mark.parametrize("world, steps", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_accumulation_steps_keep_the_global_batch(world, steps):
    assert accumulation_steps(64, 8, world) == steps
    gb = FixedGlobalBatch(64, 8, world)
    assert gb.accumulation_steps == steps and gb.records_per_rank * world == 64
    assert [gb.is_step_end(i) for i in range(steps)] == [False] * (steps - 1) + [True]


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_with_the_sizes_that_can():
    with pytest.raises(ValueError, match=r"world size 3 = 24.*world sizes \[1, 2, 4, 8\]"):
        accumulation_steps(64, 8, 3)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        accumulation_steps(64, 0, 1)


def test_without_a_process_group_the_world_is_one():
    assert FixedGlobalBatch(32, 4).accumulation_steps == 8


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch():
    torch.manual_seed(0)
    x, y = torch.randn(32, 5), torch.randn(32, 1)
    whole = torch.nn.Linear(5, 1)
    parts = torch.nn.Linear(5, 1)
    parts.load_state_dict(whole.state_dict())
    torch.nn.functional.mse_loss(whole(x), y).backward()
    gb = FixedGlobalBatch(32, 8, 1)
    for i in range(gb.accumulation_steps):
        xs, ys = x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]
        with gb.sync(parts, i):
            (torch.nn.functional.mse_loss(parts(xs), ys) * gb.loss_scale).backward()
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_sync_skips_the_all_reduce_until_the_step_ends():
    entered = []

    class Model:
        def no_sync(self):
            class Ctx:
                def __enter__(self):
                    entered.append(True)

                def __exit__(self, *exc):
                    return False

            return Ctx()

    gb = FixedGlobalBatch(16, 4, 2)
    for i in range(4):
        with gb.sync(Model(), i):
            pass
    assert len(entered) == 2  # micro-batches 0 and 2 of two steps of 2
