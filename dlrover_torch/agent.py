"""The dlrover-run elastic agent: torch's LocalElasticAgent with spare workers, hang detection,
stop hooks, node checks, and restarts that a lost node does not charge to ``max_restarts``."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from string import Template
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import LogsSpecs

from dlrover_torch import priority
from dlrover_torch.hang import HangConfig, HangDetector
from dlrover_torch.membership import (
    NEW_NODES_STOP_REASON,
    FailureFacts,
    FailureStep,
    FailureVerdict,
    RestartKind,
    failure_verdict,
    restart_verdict,
)
from dlrover_torch.preload import DEFAULT_PRELOAD
from dlrover_torch.progress import ENV_PROGRESS_FILE
from dlrover_torch.reporting import AgentReporter
from dlrover_torch.worker_pool import (
    HookedSubprocessContext,
    PooledSubprocessContext,
    SparePool,
    WorkerCommand,
)

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_SECONDS = 0.05
FAILURE_COUNTER_KEY = "dlrover/worker_failures"

# Called with a one-line reason right before a running worker group is stopped (failure, hang,
# membership change, SIGTERM, end of run). Flash checkpoint registers "persist the latest
# in-memory checkpoint" here.
StopHook = Callable[[str], None]


class NodeExcludedError(RuntimeError):
    """The node check found this node faulty or straggling and exclusion was asked for."""


@dataclass(frozen=True)
class AgentConfig:
    """What the dlrover agent adds to torch's agent, built once from the CLI."""

    hang: HangConfig = field(default_factory=HangConfig)
    spare_workers: bool = True
    spare_low_priority: bool = True  # spares warm at low CPU priority (see priority.py)
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    python: str = sys.executable
    host_worker_store: bool = True
    membership_grace_seconds: float = 0.5
    lost_node_wait_seconds: float = 12.0  # the rendezvous lease (10 s by default) and a margin


class NodeCheck:
    """Runs a node check round before training; returns False when this node must leave."""

    def run(self, agent: DLRoverElasticAgent) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class DLRoverElasticAgent(LocalElasticAgent):
    """A LocalElasticAgent that starts workers from pre-imported spares and detects hangs."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        command: WorkerCommand,
        config: AgentConfig,
        reporter: AgentReporter,
        node_check: NodeCheck | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(
            spec,
            logs_specs,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        self.command = command
        self.config = config
        self.reporter = reporter
        self.on_stop: list[StopHook] = []
        self._node_check = node_check
        self._pool = (
            SparePool(
                spec.local_world_size,
                preload=config.preload,
                python=config.python,
                command=command,
                lowering=None if config.spare_low_priority else priority.NONE,
            )
            if config.spare_workers
            else None
        )
        self._hang = HangDetector(config.hang)
        self._work_dir = tempfile.mkdtemp(prefix="dlrover_agent_")
        self._stop_reason: str | None = None
        self._last_state: WorkerState | None = None
        self._attempt = 0
        self._spares_ready = 0
        self._worker_store: TCPStore | None = None

    # -- public -----------------------------------------------------------

    def global_step(self) -> int:
        """The highest step the local workers reported (0 when they report none)."""
        return max(self._hang.last_steps().values(), default=0)

    @property
    def spare_pool(self) -> SparePool | None:
        """The spare worker processes, when enabled."""
        return self._pool

    def start_spares(self) -> None:
        """Start the spare workers now (normal priority), so they import while rendezvous runs."""
        if self._pool is not None:
            self._pool.fill()

    # -- template-method overrides ----------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._worker_store = None  # the previous round's store server goes away here
        if self._hosts_worker_store(worker_group) and worker_group.group_rank == 0:
            # A fresh store per round, listening before any worker starts: workers never wait
            # on connect retries, and never see a store or port of the group they replace.
            try:
                self._worker_store = TCPStore(
                    host_name=str(worker_group.master_addr),
                    port=int(worker_group.master_port),
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=300),
                )
            except (RuntimeError, OSError) as e:  # then rank 0's worker hosts it, as in torch
                log.warning(
                    "could not serve the workers' store on port %s: %s", worker_group.master_port, e
                )

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if self._node_check is not None:
            check, self._node_check = self._node_check, None
            if not check.run(self):
                raise NodeExcludedError(
                    "the node check excluded this node (faulty or straggling); see the log "
                    "above. Drop --exclude-straggler to keep stragglers in the job."
                )
            if self._pool is not None:
                self._pool.fill()  # the probe took a spare; the first group needs them all
        super()._initialize_workers(worker_group)

    def _hosts_worker_store(self, worker_group: WorkerGroup) -> bool:
        """Whether the rank-0 agent serves the workers' store (a fresh one every round)."""
        return self.config.host_worker_store and not worker_group.spec.rdzv_handler.use_agent_store

    def _worker_envs(self, worker_group: WorkerGroup) -> dict[int, dict[str, str]]:
        """The variables each worker gets: torchrun's set plus the step-report file."""
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        attempt_dir = os.path.join(self._work_dir, f"attempt_{self._attempt}")
        os.makedirs(attempt_dir, exist_ok=True)
        envs: dict[int, dict[str, str]] = {}
        for worker in worker_group.workers:
            env: dict[str, str] = {
                "RANK": str(worker.global_rank),
                "GROUP_RANK": str(worker_group.group_rank),
                "ROLE_RANK": str(worker.role_rank),
                "ROLE_NAME": spec.role,
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(worker.world_size),
                "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
                "ROLE_WORLD_SIZE": str(worker.role_world_size),
                "MASTER_ADDR": str(worker_group.master_addr),
                "MASTER_PORT": str(worker_group.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                # Only rank 0's worker reads it to decide whether to serve the store itself.
                "TORCHELASTIC_USE_AGENT_STORE": str(
                    spec.rdzv_handler.use_agent_store or self._worker_store is not None
                ),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                ENV_PROGRESS_FILE: os.path.join(attempt_dir, f"progress_{worker.local_rank}"),
            }
            self._set_local_rank_env(env, worker.local_rank, spec)  # torch's LOCAL_RANK/GPU rules
            if "OMP_NUM_THREADS" in os.environ:
                env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
            envs[worker.local_rank] = env
        return envs

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        if worker_group.store is None:
            raise RuntimeError("the worker group has no store: rendezvous did not complete")
        self._attempt += 1
        self._stop_reason = None
        envs = self._worker_envs(worker_group)
        prefixes: dict[int, str] | None = None
        if self._log_line_prefix_template:
            prefixes = {
                w.local_rank: Template(self._log_line_prefix_template).safe_substitute(
                    role_name=spec.role, rank=w.global_rank, local_rank=w.local_rank
                )
                for w in worker_group.workers
            }
        self._setup_local_watchdog(envs=envs)
        self._setup_healthcheck()
        if self._pool is not None:
            self._pcontext = PooledSubprocessContext(
                name=spec.role,
                pool=self._pool,
                command=self.command,
                envs=envs,
                logs_specs=self._logs_specs,
                log_line_prefixes=prefixes,
                before_close=self._before_stop,
                duplicate_stdout_filters=spec.duplicate_stdout_filters,
                duplicate_stderr_filters=spec.duplicate_stderr_filters,
            )
        else:
            cmd = self.command
            if cmd.executable:
                entrypoint, argv = cmd.target, tuple(cmd.args)
            else:
                entrypoint = self.config.python
                argv = ("-u", *(["-m"] if cmd.module else []), *cmd.argv())
            self._pcontext = HookedSubprocessContext(
                name=spec.role,
                entrypoint=entrypoint,
                args={rank: argv for rank in envs},
                envs=envs,
                logs_specs=self._logs_specs,
                log_line_prefixes=prefixes,
                before_close=self._before_stop,
                numa_options=spec.numa_options,
                duplicate_stdout_filters=spec.duplicate_stdout_filters,
                duplicate_stderr_filters=spec.duplicate_stderr_filters,
            )
        self._pcontext.start()
        if self._pool is not None:
            self._pool.refill()  # the next group's spares warm now, at low priority
        pids = self._pcontext.pids()
        self._hang.reset(pids, {rank: env[ENV_PROGRESS_FILE] for rank, env in envs.items()})
        return pids

    def _before_stop(self) -> None:
        """Runs the stop hooks once per worker group, before any of its workers is signalled."""
        reason = self._stop_reason or "the worker group ended (a worker exited)"
        for hook in list(self.on_stop):
            try:
                hook(reason)
            except Exception:
                log.exception("stop hook %r failed", hook)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pool is not None:
            self._pool.refill()  # replaces a spare that died while idle
            ready = self._pool.ready_count()
            if ready != self._spares_ready:
                self._spares_ready = ready
                log.info("%d spare worker(s) ready", ready)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            reason = self._hang.check()
            if reason is not None:
                self._stop_reason = f"hang: {reason}"
                self._first_to_fail(worker_group)  # peers failing next are not the cause
                self.reporter.event(
                    "hang",
                    reason,
                    group_rank=worker_group.group_rank,
                    restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
                    last_steps=self._hang.last_steps(),
                )
                result = RunResult(state=WorkerState.UNHEALTHY)
        elif result.state == WorkerState.FAILED:
            ranks = sorted(result.failures)
            codes = [result.failures[r].exitcode for r in ranks]
            verdict = self._failure_verdict(worker_group, codes)
            log.debug("worker failure: %s (%s)", verdict.step.value, verdict.reason)
            if verdict.step is FailureStep.MEMBERSHIP_CHANGE:
                # Another node restarted first or a node was lost: re-rendezvous like a
                # membership change (torch's loop does so when the group looks healthy and
                # nodes are waiting), without spending a restart of this node.
                self._stop_reason = "membership change: a peer node restarted or was lost"
                self.reporter.event(
                    "membership",
                    f"local workers {ranks} failed (exit codes {codes}) after a peer node "
                    "restarted or was lost; re-rendezvous without counting a restart",
                    group_rank=worker_group.group_rank,
                )
                result = RunResult(state=WorkerState.HEALTHY)
            else:
                self.reporter.event(
                    "worker_failure",
                    f"worker(s) with global rank {ranks} failed with exit code(s) {codes}",
                    group_rank=worker_group.group_rank,
                )
        self._last_state = result.state
        return result

    def _first_to_fail(self, worker_group: WorkerGroup) -> bool:
        """Whether this node is the first of its round to report a worker failure (a counter in
        the round's store); the others' workers most likely died of the broken connection."""
        store = worker_group.store
        if store is None:
            return True
        try:
            return int(store.add(FAILURE_COUNTER_KEY, 1)) == 1
        except Exception as e:  # the store is gone with the round: decide by waiting instead
            log.debug("failure counter unavailable: %s", e)
            return False

    def _failure_verdict(self, worker_group: WorkerGroup, codes: list[int]) -> FailureVerdict:
        """Observes what ``failure_verdict`` asks for (the round's failure counter, the nodes
        waiting at the rendezvous) until it decides."""
        facts = FailureFacts(
            group_world_size=worker_group.group_world_size,
            exit_codes=tuple(codes),
            remaining_restarts=self._remaining_restarts,
        )
        handler = worker_group.spec.rdzv_handler
        started = time.monotonic()
        while True:
            verdict = failure_verdict(
                facts, self.config.membership_grace_seconds, self.config.lost_node_wait_seconds
            )
            if verdict.step is FailureStep.ASK_FIRST:
                facts = replace(facts, first_to_fail=self._first_to_fail(worker_group))
                started = time.monotonic()
            elif verdict.step is FailureStep.POLL:
                if facts.nodes_waiting is not None:
                    time.sleep(MEMBERSHIP_POLL_SECONDS)
                waiting = handler.num_nodes_waiting()
                facts = replace(
                    facts, nodes_waiting=waiting, waited_seconds=time.monotonic() - started
                )
            else:
                return verdict

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        previous_nodes = worker_group.group_world_size
        cause = self._last_state
        if cause == WorkerState.HEALTHY:
            self._stop_reason = NEW_NODES_STOP_REASON
        super()._restart_workers(worker_group)
        verdict = restart_verdict(cause, previous_nodes, worker_group.group_world_size)
        if verdict.refund:
            self._remaining_restarts += 1
        if verdict.kind is not RestartKind.FAULT:
            self.reporter.event("membership", verdict.reason, group_rank=worker_group.group_rank)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._stop_reason is None:
            self._stop_reason = f"the agent is shutting down ({death_sig.name} to the workers)"
        super()._shutdown(death_sig, timeout)

    def close(self) -> None:
        """Retire spare workers and remove the agent's scratch files."""
        self._worker_store = None
        if self._pool is not None:
            self._pool.close()
        shutil.rmtree(self._work_dir, ignore_errors=True)
