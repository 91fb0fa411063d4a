"""The rendezvous round state machine of one run: pure, time is passed in, no threads.

A round forms from the nodes that joined. It closes when `max_nodes` joined, or when at least
`min_nodes` joined and nobody new came for `last_call_seconds`; its size is rounded down to a
multiple of `node_unit`. Ranks follow (rank_hint, type, rank). Nodes that joined but were not
admitted (max reached, unit rounding) or came after the round closed wait for the next round,
which may form only once a member re-joins (re-rendezvous) or no member of the current round is
left. A node silent for `lease_seconds` is lost: removed from the joining set, and a lost member
breaks its round so the rest re-rendezvous at a smaller size. Round numbers fence stale calls.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

NodeKey = tuple[str, int]  # (type, rank): one slot, whatever its incarnation


class StaleRoundError(Exception):
    """The call names a round or node incarnation that is no longer current."""


class RendezvousClosedError(Exception):
    """The rendezvous was closed: no more rounds will form."""


@dataclass(frozen=True)
class RoundConfig:
    """How rounds of one run form; the first join fixes it."""

    min_nodes: int
    max_nodes: int
    node_unit: int = 1
    last_call_seconds: float = 1.0
    lease_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})"
            )
        if self.node_unit < 1:
            raise ValueError(f"node_unit must be >= 1, got {self.node_unit}")
        if (self.max_nodes // self.node_unit) * self.node_unit < self.min_nodes:
            raise ValueError(
                f"no multiple of node_unit={self.node_unit} lies in [min_nodes={self.min_nodes}, "
                f"max_nodes={self.max_nodes}]; widen the range or change node_unit"
            )
        if not self.last_call_seconds >= 0:
            raise ValueError(f"last_call_seconds must be >= 0, got {self.last_call_seconds}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")

    def round_size(self, available: int) -> int:
        """Nodes a round admits out of `available`: 0 when that is below min_nodes."""
        size = (min(available, self.max_nodes) // self.node_unit) * self.node_unit
        return size if size >= self.min_nodes else 0


@dataclass(frozen=True)
class Participant:
    """One node incarnation taking part in the rendezvous."""

    type: str
    rank: int
    id: int
    rank_hint: int = 0
    local_world_size: int = 1
    host: str = ""

    @property
    def key(self) -> NodeKey:
        return (self.type, self.rank)

    @property
    def name(self) -> str:
        return f"{self.type}-{self.rank} (id {self.id})"


def _participant_record(p: Participant) -> dict:
    """asdict(p), written out: a snapshot makes one per node at every change of a run."""
    return {
        "type": p.type,
        "rank": p.rank,
        "id": p.id,
        "rank_hint": p.rank_hint,
        "local_world_size": p.local_world_size,
        "host": p.host,
    }


@dataclass(frozen=True)
class Round:
    """A closed round: its number and its members in rank order."""

    number: int
    members: tuple[Participant, ...]

    def rank_of(self, key: NodeKey) -> int | None:
        for rank, member in enumerate(self.members):
            if member.key == key:
                return rank
        return None


class WaitStatus(str, enum.Enum):
    PENDING = "pending"  # the awaited round is still forming
    DONE = "done"  # the round closed with the node in it
    NEXT = "next"  # the round closed without the node: it waits for the next one
    CLOSED = "closed"


@dataclass(frozen=True)
class WaitResult:
    """What a joined node learns about the round it waits for."""

    status: WaitStatus
    round: int
    rank: int = -1
    members: tuple[Participant, ...] = ()


@dataclass
class _Joined:
    participant: Participant
    seq: int  # arrival order: the first arrivals are admitted when more joined than fit
    first_round: int  # the round number the node was told to wait for when it joined


@dataclass
class RoundStateMachine:
    """Rounds of one run (see the module docstring); every method takes `now` where time matters."""

    config: RoundConfig
    number: int = 0  # the last closed round; 0 before the first
    closed: bool = False
    current: Round | None = None
    _joining: dict[NodeKey, _Joined] = field(default_factory=dict)
    _ids: dict[NodeKey, int] = field(default_factory=dict)  # latest incarnation per slot
    _seen: dict[NodeKey, float] = field(default_factory=dict)  # leases of live nodes
    _lost: set[NodeKey] = field(default_factory=set)  # members of `current` that were lost
    _departed: set[NodeKey] = field(default_factory=set)  # members that left gracefully
    _last_join: float = 0.0
    _seq: int = 0
    # Bumped by every change snapshot() would show (not by lease renewals): what to persist.
    version: int = 0
    # No lease runs out before this instant (a lower bound: renewals only push leases later),
    # so advance() scans the leases only once it has passed, not at every call.
    _lease_check_at: float = float("-inf")

    # -- calls from nodes ---------------------------------------------------

    def join(self, p: Participant, now: float) -> int:
        """Add a node to the round being formed; returns the round number it waits for."""
        if self.closed:
            raise RendezvousClosedError("the rendezvous is closed")
        previous = self._ids.get(p.key)
        if previous is not None and previous != p.id and self._is_member(p.key):
            log.info("%s replaces id %d: its round %d is broken", p.name, previous, self.number)
            self._lost.add(p.key)
        entry = self._joining.get(p.key)
        if entry is None or entry.participant != p:
            self._seq += 1
            self._joining[p.key] = _Joined(p, self._seq, self.number + 1)
            self._last_join = now
        self._ids[p.key] = p.id
        self._seen[p.key] = now
        self._departed.discard(p.key)
        self.version += 1
        return self.number + 1

    def wait_status(self, key: NodeKey, node_id: int, round_number: int) -> WaitResult:
        """Where a joined node stands with respect to the round it waits for."""
        if self.closed:
            return WaitResult(WaitStatus.CLOSED, self.number)
        self._check_id(key, node_id)
        entry = self._joining.get(key)
        if entry is not None:
            if round_number > self.number + 1 or round_number < entry.first_round:
                raise StaleRoundError(
                    f"{entry.participant.name} waits for round {self.number + 1}, "
                    f"not round {round_number}"
                )
            if round_number == self.number + 1:
                return WaitResult(WaitStatus.PENDING, round_number)
            return WaitResult(WaitStatus.NEXT, self.number + 1)
        if self.current is not None and round_number == self.number:
            rank = self.current.rank_of(key)
            if rank is not None:
                return WaitResult(WaitStatus.DONE, self.number, rank, self.current.members)
        raise StaleRoundError(
            f"{key[0]}-{key[1]} is neither in round {round_number} nor joining the next one "
            f"(current round {self.number}); join again"
        )

    def waiting(self, key: NodeKey, node_id: int, round_number: int) -> int:
        """Nodes that need the members of `round_number` to re-rendezvous (0: carry on)."""
        if self.closed:
            return 0
        self._check_id(key, node_id)
        if round_number != self.number or self.current is None:
            raise StaleRoundError(
                f"round {round_number} is over; the current round is {self.number}"
            )
        if self.current.rank_of(key) is None:
            raise StaleRoundError(f"{key[0]}-{key[1]} is not a member of round {self.number}")
        members = {m.key for m in self.current.members}
        joining = len(self._joining)
        if self._lost:
            return max(1, joining)
        if members & self._joining.keys():
            return joining
        if self.config.round_size(len(members) + joining) > len(members):
            return joining
        return 0

    def touch(self, key: NodeKey, node_id: int, now: float) -> None:
        """Renew a live node's lease."""
        if key in self._seen and self._ids.get(key) == node_id:
            self._seen[key] = now

    def leave(self, key: NodeKey, node_id: int) -> None:
        """A node is done: it stops waiting and its silence no longer counts as a loss."""
        if self._ids.get(key) != node_id:
            return
        self._joining.pop(key, None)
        self._seen.pop(key, None)
        if self._is_member(key):
            self._departed.add(key)
        self.version += 1

    def lose(self, key: NodeKey, node_id: int) -> None:
        """The master saw this incarnation die: lost now, not when its lease runs out."""
        if self._ids.get(key) == node_id and key in self._seen:
            self._expire(key)

    def set_closed(self) -> None:
        self.closed = True
        self.version += 1

    # -- time ---------------------------------------------------------------

    def advance(
        self, now: float, describe_silent: Callable[[NodeKey], str] | None = None
    ) -> Round | None:
        """Expire leases, then close the forming round if it may; returns a newly closed round.
        `describe_silent(key)` says what a node whose lease lapsed is doing, for the warning."""
        if now >= self._lease_check_at:
            lease = self.config.lease_seconds
            for key, seen in list(self._seen.items()):
                if now > seen + lease:
                    cause = describe_silent(key) if describe_silent is not None else ""
                    self._expire(key, f"silent > {lease}s" + (f"; {cause}" if cause else ""))
            self._lease_check_at = min(self._seen.values(), default=now) + lease
        return self._try_close(now)

    def id_of(self, key: NodeKey) -> int | None:
        """The latest incarnation id known for a node slot."""
        return self._ids.get(key)

    def next_deadline(self) -> float | None:
        """The next instant at which advance() could change something by itself (possibly a
        little early: then advance() finds nothing due and a later deadline follows)."""
        times = [self._lease_check_at] if self._seen else []
        if self._may_form() and self.config.round_size(len(self._joining)):
            times.append(self._last_join + self.config.last_call_seconds)
        return min(times) if times else None

    # -- internals ----------------------------------------------------------

    def _is_member(self, key: NodeKey) -> bool:
        return self.current is not None and self.current.rank_of(key) is not None

    def _check_id(self, key: NodeKey, node_id: int) -> None:
        known = self._ids.get(key)
        if known is not None and known != node_id:
            raise StaleRoundError(
                f"{key[0]}-{key[1]} id {node_id} is an old incarnation; the current one is {known}"
            )

    def _expire(self, key: NodeKey, why: str = "its process ended") -> None:
        self.version += 1
        self._seen.pop(key, None)
        entry = self._joining.pop(key, None)
        if self._is_member(key) and key not in self._departed:
            self._lost.add(key)
            log.warning("%s-%s lost (%s): round %d is broken", key[0], key[1], why, self.number)
        elif entry is not None:
            log.warning("%s lost while waiting for a round (%s)", entry.participant.name, why)

    def _may_form(self) -> bool:
        """A new round may form: no round yet, a member re-joined, or no member is left."""
        if self.closed:
            return False
        if self.current is None:
            return True
        members = {m.key for m in self.current.members}
        if members & self._joining.keys():
            return True
        return not (members - self._lost - self._departed)

    def _try_close(self, now: float) -> Round | None:
        if not self._may_form():
            return None
        size = self.config.round_size(len(self._joining))
        if size == 0:
            return None
        full = len(self._joining) >= self.config.max_nodes
        # Same expression as next_deadline(), so waking at the deadline always closes.
        if not full and now < self._last_join + self.config.last_call_seconds:
            return None
        admitted = sorted(self._joining.values(), key=lambda e: e.seq)[:size]
        members = tuple(
            sorted(
                (e.participant for e in admitted),
                key=lambda p: (p.rank_hint, p.type, p.rank),
            )
        )
        old = {m.key for m in self.current.members} if self.current else set()
        for member in members:
            del self._joining[member.key]
        self.number += 1
        self.version += 1
        self.current = Round(self.number, members)
        self._lost = set()
        self._departed = set()
        # Members of the old round that neither made it nor re-joined are forgotten.
        for key in old - {m.key for m in members} - self._joining.keys():
            self._seen.pop(key, None)
        log.info(
            "round %d closed with %d node(s); %d waiting",
            self.number,
            len(members),
            len(self._joining),
        )
        return self.current

    @property
    def joining_count(self) -> int:
        return len(self._joining)

    # -- durability -----------------------------------------------------------

    def snapshot(self) -> dict:
        """Everything a restarted master needs to go on with this run, as plain JSON data.

        Leases are not times but the set of live nodes: a restored run gives each a fresh lease."""
        return {
            "round": self.number,
            "closed": self.closed,
            "config": asdict(self.config),
            "members": None
            if self.current is None
            else [_participant_record(m) for m in self.current.members],
            "joining": [
                {
                    "node": _participant_record(e.participant),
                    "seq": e.seq,
                    "first_round": e.first_round,
                }
                for e in sorted(self._joining.values(), key=lambda e: e.seq)
            ],
            "ids": sorted([t, r, i] for (t, r), i in self._ids.items()),
            "live": sorted([t, r] for t, r in self._seen),
            "lost": sorted([t, r] for t, r in self._lost),
            "departed": sorted([t, r] for t, r in self._departed),
            "seq": self._seq,
        }

    @classmethod
    def restore(cls, saved: dict, now: float) -> RoundStateMachine:
        """The run a snapshot() describes; every live node's lease and the last call start now.

        A record from before membership was saved (only round, closed, config) restores the
        round number alone, as then: its members must re-rendezvous."""
        run = cls(RoundConfig(**saved["config"]), number=int(saved["round"]))
        run.closed = bool(saved["closed"])
        members = saved.get("members")
        if members is not None:
            run.current = Round(run.number, tuple(Participant(**m) for m in members))
        for entry in saved.get("joining", ()):
            p = Participant(**entry["node"])
            run._joining[p.key] = _Joined(p, int(entry["seq"]), int(entry["first_round"]))
        run._ids = {(t, int(r)): int(i) for t, r, i in saved.get("ids", ())}
        run._seen = {(t, int(r)): now for t, r in saved.get("live", ())}
        run._lost = {(t, int(r)) for t, r in saved.get("lost", ())}
        run._departed = {(t, int(r)) for t, r in saved.get("departed", ())}
        run._seq = int(saved.get("seq", 0))
        run._last_join = now
        return run

    def renew_leases(self, now: float, grace: float = 0.0) -> None:
        """Give every live node a full lease from now plus `grace` (and restart a pending last
        call): a restarted master allows for the clients' reconnect backoff this way."""
        for key in self._seen:
            self._seen[key] = now + grace
        self._last_join = now

    @property
    def in_progress(self) -> bool:
        """Whether nodes are in a round or waiting for one (what a restarted master must keep)."""
        return not self.closed and (self.current is not None or bool(self._joining))
