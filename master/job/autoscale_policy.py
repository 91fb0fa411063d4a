"""The auto-scaler's policy: more workers while each added one still pays, a hot PS moved to more.

`decide` is a pure function from the settings (the job YAML's `autoscale:` section), the
scaler's own state and one `Observation` (throughput, worker count, PS loads) to a new state
and a `Decision` with its reason. master.job.autoscaler samples the job and calls it; the job
applies the decision (master.job.scaling).

Workers: a table of measured records/s per worker count. From the count it is at, the scaler
adds one worker; once the new count is measured, the addition is judged: it paid if it brought
at least `marginal_gain` of the per-trainer rate before it, and then the next one is tried. An
addition that did not pay is undone and its count becomes a ceiling, so the count goes up step
by step, comes down at most once, and then holds: it cannot flap. Every change is followed by
`settle_seconds` and a fresh measurement (the median of `window` samples, taken only while
every trainer is stepping and nothing else is in flight) before the next decision.

PS: a PS whose CPU (of its requested cores) or resident memory (of its limit) stays above the
thresholds for a whole window is migrated with `ps_growth` times more of that resource, within
`ps_max_cpu` / `ps_max_memory_mb` and the job's total budget. A PS that ran out of memory anyway
is relaunched with more by the relaunch policy (master.nodes.policy), not here. A migration
removes a bottleneck, so the worker table starts over after it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from master.config import AutoscaleSpec

log = logging.getLogger(__name__)

NONE = "none"
SCALE_WORKERS = "scale_workers"
MIGRATE_PS = "migrate_ps"


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class PSLoad:
    """One PS as its latest heartbeat showed it, with the resources it was given."""

    rank: int
    cpu_percent: float  # psutil: 100 = one core busy
    cpu_cores: float  # requested cores; 0 = unknown (CPU-bound cannot be judged)
    memory_rss_mb: float
    memory_limit_mb: float  # requested or cgroup limit; 0 = unknown

    @property
    def cpu_share(self) -> float:
        """Busy fraction of its cores (0 when the cores are unknown)."""
        return self.cpu_percent / (100.0 * self.cpu_cores) if self.cpu_cores > 0 else 0.0

    @property
    def memory_share(self) -> float:
        """Used fraction of its memory limit (0 when the limit is unknown)."""
        return self.memory_rss_mb / self.memory_limit_mb if self.memory_limit_mb > 0 else 0.0


@dataclass(frozen=True)
class Observation:
    """What the scaler sees at one sample."""

    time: float  # monotonic seconds
    workers: int  # worker replicas the job runs now
    worker_slots: int  # the most workers the cluster spec allows
    chief: int = 0  # 1 if a chief trains too (it counts as a trainer)
    ready: int = 0  # trainers (chief and workers) running and stepping
    records_per_second: float = 0.0  # since the previous sample
    records_todo: int = 1  # records not yet handed out (all epochs)
    ps: tuple[PSLoad, ...] = ()
    busy: str = ""  # why nothing may change now (a migration in flight), "" if free
    cpu_requested: float = 0.0  # cores requested by every running node
    memory_requested_mb: int = 0
    worker_cpu: float = 0.0  # cores one more worker requests
    worker_memory_mb: int = 0


@dataclass(frozen=True)
class Decision:
    """What to do, and why, in words a person reads in the job's events."""

    action: str = NONE  # none | scale_workers | migrate_ps
    reason: str = ""
    workers: int = 0  # scale_workers: the new count
    ps_rank: int = -1  # migrate_ps: which PS
    cpu: float = 0.0  # migrate_ps: new cores (0: unchanged)
    memory_mb: int = 0  # migrate_ps: new memory (0: unchanged)


@dataclass(frozen=True)
class ScalerState:
    """What the scaler remembers between samples (never mutated: `decide` returns a new one)."""

    workers: int = -1  # the count the current measurement is of (-1: none yet)
    since: float = 0.0  # when that count (or the last change) began
    samples: tuple[float, ...] = ()  # records/s at `workers` since it settled
    table: Mapping[int, float] = field(default_factory=dict)  # measured records/s per count
    came_from: int = -1  # the count before the scaler's last change of workers (-1: none)
    ceiling: int = 0  # a count whose addition did not pay: never exceeded again (0: none)
    ps_samples: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    hint: int = 0  # a starting count to go to first (the Brain's history), 0: none
    hint_reason: str = ""


def initial_state(hint: int = 0, hint_reason: str = "") -> ScalerState:
    """The state of a scaler that has measured nothing; `hint` is a first count to try."""
    return ScalerState(hint=max(0, hint), hint_reason=hint_reason)


# ---------------------------------------------------------------------------------------------
# The decision


def worker_limits(cfg: AutoscaleSpec, obs: Observation) -> tuple[int, int]:
    """The (min, max) worker counts the scaler keeps to."""
    top = min(cfg.max_workers or obs.worker_slots, obs.worker_slots)
    return min(cfg.min_workers, top), top


def decide(cfg: AutoscaleSpec, st: ScalerState, obs: Observation) -> tuple[ScalerState, Decision]:
    """The next state and decision for one observation. Pure: same inputs, same outputs."""
    lo, hi = worker_limits(cfg, obs)
    n = obs.workers
    if obs.busy:
        # Whatever was being measured is disturbed: start over once it is done.
        st = _restart(st, n, obs.time) if n == st.workers else _changed(st, -1, n, obs.time)
        return st, Decision(reason=f"waiting: {obs.busy}")
    if n < lo:
        return _changed(st, n, lo, obs.time), Decision(
            SCALE_WORKERS, f"{n} workers is below autoscale.min_workers ({lo})", workers=lo
        )
    if n > hi:
        return _changed(st, n, hi, obs.time), Decision(
            SCALE_WORKERS, f"{n} workers is above autoscale.max_workers ({hi})", workers=hi
        )
    if st.hint:
        target = min(max(st.hint, lo), hi)
        st = dataclasses.replace(st, hint=0)
        if target != n:
            return _changed(st, n, target, obs.time), Decision(
                SCALE_WORKERS,
                f"starting from {target} workers: {st.hint_reason or 'a hint'}",
                workers=target,
            )
    if n != st.workers:
        # The count changed by other hands (a command, a restarted master): measure it afresh.
        st = dataclasses.replace(_restart(st, n, obs.time), came_from=-1)
        return st, Decision(reason=f"measuring {n} workers")
    if obs.time - st.since < cfg.settle_seconds:
        return st, Decision(reason=f"settling after the change to {n} workers")
    if obs.ready < n + obs.chief:
        return st, Decision(
            reason=f"waiting for every trainer to step ({obs.ready}/{n + obs.chief})"
        )
    if obs.records_todo <= 0:
        return st, Decision(reason="holding: no records left to hand out")
    samples = (*st.samples, max(0.0, obs.records_per_second))[-cfg.window :]
    ps_samples = {
        p.rank: (*st.ps_samples.get(p.rank, ()), (p.cpu_share, p.memory_share))[-cfg.window :]
        for p in obs.ps
    }
    st = dataclasses.replace(st, samples=samples, ps_samples=ps_samples)
    if len(samples) < cfg.window:
        return st, Decision(reason=f"measuring {n} workers ({len(samples)}/{cfg.window} samples)")
    rate = statistics.median(samples)
    st = dataclasses.replace(st, table={**st.table, n: rate})

    migrate = _hot_ps(cfg, st, obs)
    if migrate is not None:
        # The bottleneck moves: what workers were worth before says nothing about after.
        return ScalerState(workers=n, since=obs.time), migrate

    # Judge the scaler's last addition, now measured.
    prev = st.table.get(n - 1)
    if st.came_from == n - 1 and prev is not None:
        trainers = n - 1 + obs.chief
        per_trainer = prev / trainers if trainers else 0.0
        gain = rate - prev
        if per_trainer > 0 and gain < cfg.marginal_gain * per_trainer:
            judged = (
                f"worker {n} added {gain:,.1f} records/s ({rate:,.1f} vs {prev:,.1f}), "
                f"{100 * gain / per_trainer:.0f}% of the {per_trainer:,.1f} per trainer before "
                f"it (autoscale.marginal_gain {100 * cfg.marginal_gain:.0f}%)"
            )
            st = dataclasses.replace(st, ceiling=n - 1)
            if n - 1 >= lo:
                return _changed(st, n, n - 1, obs.time), Decision(
                    SCALE_WORKERS, f"back to {n - 1} workers: {judged}", workers=n - 1
                )
            return st, Decision(reason=f"holding at {n} (autoscale.min_workers): {judged}")
    cap = min(hi, st.ceiling) if st.ceiling else hi
    if n >= cap:
        why = (
            f"adding worker {cap + 1} did not pay"
            if st.ceiling and st.ceiling < hi
            else f"autoscale.max_workers is {hi}"
        )
        return st, Decision(reason=f"holding at {n} workers ({rate:,.1f} records/s): {why}")
    over = _over_budget(cfg, obs, obs.worker_cpu, obs.worker_memory_mb)
    if over:
        return st, Decision(reason=f"holding at {n} workers: one more would exceed {over}")
    if prev is not None and st.came_from == n - 1:
        why = f"worker {n} paid ({prev:,.1f} -> {rate:,.1f} records/s)"
    else:
        why = f"{rate:,.1f} records/s with {n}"
    return _changed(st, n, n + 1, obs.time), Decision(
        SCALE_WORKERS, f"trying {n + 1} workers: {why}", workers=n + 1
    )


def _restart(st: ScalerState, workers: int, now: float) -> ScalerState:
    """Measure `workers` from scratch, from `now` on."""
    return dataclasses.replace(st, workers=workers, since=now, samples=(), ps_samples={})


def _changed(st: ScalerState, old: int, new: int, now: float) -> ScalerState:
    """The scaler moves workers from `old` to `new`: settle, then measure `new`."""
    return dataclasses.replace(_restart(st, new, now), came_from=old)


def _hot_ps(cfg: AutoscaleSpec, st: ScalerState, obs: Observation) -> Decision | None:
    """A migration for the first PS hot for a whole window that may still grow, else None."""
    for p in obs.ps:
        window = st.ps_samples.get(p.rank, ())
        if len(window) < cfg.window:
            continue
        cpu_hot = all(c >= cfg.ps_cpu_percent / 100 for c, _ in window)
        mem_hot = all(m >= cfg.ps_memory_percent / 100 for _, m in window)
        cpu = memory_mb = 0.0
        why = []
        if cpu_hot and cfg.ps_max_cpu > p.cpu_cores:
            cpu = min(cfg.ps_max_cpu, p.cpu_cores * cfg.ps_growth)
            why.append(
                f"CPU-bound (its {p.cpu_cores:g} cores at least "
                f"{100 * min(c for c, _ in window):.0f}% busy over {len(window)} samples)"
            )
        if mem_hot and cfg.ps_max_memory_mb > p.memory_limit_mb:
            memory_mb = min(cfg.ps_max_memory_mb, math.ceil(p.memory_limit_mb * cfg.ps_growth))
            why.append(
                f"memory-bound ({p.memory_rss_mb:,.0f} of {p.memory_limit_mb:,.0f} MB, "
                f"at least {100 * min(m for _, m in window):.0f}% over {len(window)} samples)"
            )
        if not why:
            continue
        over = _over_budget(
            cfg,
            obs,
            cpu - p.cpu_cores if cpu else 0.0,
            int(memory_mb - p.memory_limit_mb) if memory_mb else 0,
        )
        if over:
            log.info("ps-%d is hot but moving it would exceed %s", p.rank, over)
            continue
        to = ", ".join(
            part
            for part in (f"{cpu:g} CPU" if cpu else "", f"{memory_mb:.0f} MB" if memory_mb else "")
            if part
        )
        return Decision(
            MIGRATE_PS,
            f"ps-{p.rank} is {' and '.join(why)}: moving it to {to}",
            ps_rank=p.rank,
            cpu=cpu,
            memory_mb=int(memory_mb),
        )
    return None


def _over_budget(cfg: AutoscaleSpec, obs: Observation, more_cpu: float, more_mb: int) -> str:
    """Which job budget asking for `more_cpu` cores and `more_mb` MB would break ('' if none)."""
    if cfg.max_total_cpu and obs.cpu_requested + more_cpu > cfg.max_total_cpu + 1e-9:
        return f"autoscale.max_total_cpu ({cfg.max_total_cpu:g} cores)"
    if cfg.max_total_memory_mb and obs.memory_requested_mb + more_mb > cfg.max_total_memory_mb:
        return f"autoscale.max_total_memory_mb ({cfg.max_total_memory_mb} MB)"
    return ""
