"""Who restarts when ranks moved to new addresses with a lost host: a TF server keeps the
cluster spec it started with, so the peers that dial a moved rank start again with the new one.

The chief and workers dial every PS; a PS dials the chief and workers (in TF1 PS training it
pulls their tensors by the address in its own spec). Ranks that moved are relaunched by their
own end with the new spec, so they are never restarted here. Pure: master.job.exits acts."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from master.nodes.model import Node

TRAINER_TYPES = ("chief", "worker")  # the ranks a PS dials and that dial every PS


@dataclass(frozen=True)
class MoveRestarts:
    """The running nodes to restart with the new cluster spec, and why."""

    trainers: tuple[Node, ...] = ()  # for a moved PS: coordinator restarts (no budget used)
    ps: tuple[Node, ...] = ()  # for a moved chief or worker: PS failures (no budget used)
    moved_trainers: str = ""  # the moved chief and workers, e.g. "worker-1", for the PS's events


def plan_move_restarts(
    moved: Collection[tuple[str, int]],
    running: Iterable[Node],
    training_done: bool,
    following: Collection[int] = (),
) -> MoveRestarts:
    """The restarts `moved` (type, rank)s call for among the `running` current nodes. None
    once training is done; none already restarting; none of the nodes `following` the moved
    ranks in place (ids: their platform forwards to peers); a job without PS (torch) has
    none."""
    if training_done:
        return MoveRestarts()
    names = {f"{t}-{r}" for t, r in moved}
    stay = [
        n for n in running if not n.state.ended and n.name not in names and n.id not in following
    ]
    trainers = tuple(
        n
        for n in stay
        if any(t == "ps" for t, _ in moved)
        and n.type in TRAINER_TYPES
        and not n.coordinator_restart
    )
    moved_trainers = ", ".join(sorted(f"{t}-{r}" for t, r in moved if t in TRAINER_TYPES))
    ps = tuple(n for n in stay if moved_trainers and n.type == "ps" and not n.restart_for_move)
    return MoveRestarts(trainers, ps, moved_trainers if ps else "")
