"""dlrover-run: a drop-in for torchrun whose agent restarts faster and survives node changes."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing.api import (
    DefaultLogsSpecs,
    LogsSpecs,
    SignalException,
    Std,
)
from torch.distributed.elastic.multiprocessing.errors import (
    _NOT_AVAILABLE,
    ChildFailedError,
    get_error_handler,
)
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from dlrover_torch.agent import AgentConfig, DLRoverElasticAgent, NodeExcludedError
from dlrover_torch.launch_config import LaunchConfig, LaunchConfigError, config_from_args
from dlrover_torch.reporting import AgentReporter

log = logging.getLogger("dlrover_torch.run")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_EXCLUDED = 3


@dataclass
class _Resources:
    """What main() started and must stop again, in reverse order."""

    closers: list[Callable[[], Any]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception as e:  # cleanup must go on
                log.warning("cleanup step failed: %s", e)


@dataclass
class Rendezvous:
    """The rendezvous handler for the training rounds, and where the agent reports events."""

    handler: RendezvousHandler
    reporter: AgentReporter
    check_handler: Callable[[], RendezvousHandler] | None = None
    job_client: Any = None  # the MasterClient when a job master launched this node


def _torch_rendezvous(cfg: LaunchConfig, run_id: str, suffix: str = "") -> RendezvousHandler:
    """A handler from torch's registry (c10d, static, etcd); its store is never the workers'."""
    params = RendezvousParameters(
        backend=cfg.rdzv_backend,
        endpoint=cfg.rdzv_endpoint,
        run_id=run_id + suffix,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        local_addr=cfg.local_addr,
        **cfg.rdzv_configs,
    )
    return rdzv_registry.get_rendezvous_handler(params)


def _master_rendezvous(
    cfg: LaunchConfig, env: Mapping[str, str], resources: _Resources
) -> Rendezvous:
    """The dlrover master's rendezvous and KV store; starts a local master when none is given."""
    from dlrover_torch.rendezvous import MasterRendezvousHandler
    from master.client import KVClient, MasterClient, RendezvousClient, read_token

    addr, local_addr = cfg.master_addr, cfg.local_addr
    if addr:
        token = read_token(env)
    else:
        from master.rpc.standalone import start_standalone_master

        server, port, token = start_standalone_master(host="127.0.0.1", port=0)
        resources.closers.append(lambda: server.stop(grace=None))
        addr, local_addr = f"127.0.0.1:{port}", local_addr or "127.0.0.1"
        log.info("started a local dlrover master at %s", addr)
    client = MasterClient(addr, token)
    resources.closers.append(client.close)
    kv = KVClient(client)
    client.node, node_rank = _node_identity(cfg, env, kv)
    rdzv_client = RendezvousClient(client)
    conf = cfg.rdzv_configs

    def handler(run_id: str, min_nodes: int, last_call: float) -> RendezvousHandler:
        return MasterRendezvousHandler(
            rdzv_client,
            kv,
            run_id=run_id,
            node_rank_hint=node_rank,
            local_world_size=cfg.nproc_per_node,
            min_nodes=min_nodes,
            max_nodes=cfg.max_nodes,
            node_unit=cfg.node_unit,
            last_call_seconds=last_call,
            join_timeout_seconds=float(conf.get("join_timeout", 600)),
            lease_seconds=float(conf.get("lease_timeout", 10)),
            local_addr=local_addr,
        )

    last_call = float(conf.get("last_call_timeout", 1.0))
    main_handler = handler(cfg.run_id, cfg.min_nodes, last_call)
    reporter = AgentReporter(cfg.run_id, node_rank, kv)
    from master.client import ENV_NODE_TYPE

    return Rendezvous(
        main_handler,
        reporter,
        check_handler=lambda: handler(f"{cfg.run_id}-node-check", 1, max(last_call, 2.0)),
        job_client=client if env.get(ENV_NODE_TYPE) else None,
    )


def _start_heartbeats(client: Any, agent: DLRoverElasticAgent, resources: _Resources) -> None:
    """Under a job master: register this node and send heartbeats with stats and the step."""
    from master.client import HeartbeatThread

    reply = client.register(socket.gethostname(), os.getpid())
    interval = max(reply.heartbeat_interval_ms / 1000.0, 0.5) or 2.0

    def on_command(cmd: Any) -> None:
        log.info("master command %s: %s", cmd.kind, cmd.reason)

    beat = HeartbeatThread(client, interval, on_command=on_command, global_step=agent.global_step)
    beat.start()
    # Beats stop last: the master must not take a node whose cleanup is slow (spares exiting,
    # the last checkpoint persisting) for a dead one and kill it mid-way.
    resources.closers.insert(0, beat.stop)


def _node_identity(cfg: LaunchConfig, env: Mapping[str, str], kv: Any) -> tuple[Any, int]:
    """This agent's (identity, node rank): the master-given one under `dlrover submit`, else
    --node-rank, else a rank the master hands out (so agents started by hand never collide)."""
    from master.client import ENV_NODE_ID, ENV_NODE_TYPE, NodeIdentity

    if env.get(ENV_NODE_TYPE):
        rank = cfg.node_rank
        return NodeIdentity(env[ENV_NODE_TYPE], rank, int(env.get(ENV_NODE_ID, "0"))), rank
    if cfg.node_rank_given:
        rank = cfg.node_rank
    else:
        rank = kv.add(f"dlrover/node_ranks/{cfg.run_id}".encode(), 1) - 1
    uid = (os.getpid() << 16) ^ (hash(socket.gethostname()) & 0xFFFF)
    return NodeIdentity("worker", rank, uid), rank


def _rendezvous(cfg: LaunchConfig, env: Mapping[str, str], resources: _Resources) -> Rendezvous:
    if cfg.uses_master:
        return _master_rendezvous(cfg, env, resources)
    run_id = cfg.run_id
    return Rendezvous(
        _torch_rendezvous(cfg, run_id),
        AgentReporter(run_id, cfg.node_rank),
        check_handler=lambda: _torch_rendezvous(cfg, run_id, "-node-check"),
    )


def build_agent(
    cfg: LaunchConfig, env: Mapping[str, str], resources: _Resources
) -> DLRoverElasticAgent:
    """The agent for this node, with its rendezvous and (when asked) its node check."""
    rdzv = _rendezvous(cfg, env, resources)
    resources.closers.append(rdzv.handler.shutdown)
    _say_replaced(cfg, rdzv.reporter)
    spec = WorkerSpec(
        role=cfg.role,
        local_world_size=cfg.nproc_per_node,
        rdzv_handler=rdzv.handler,
        entrypoint=cfg.python,
        args=tuple(cfg.command.argv()),
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
        master_addr=cfg.static_master_addr if cfg.rdzv_backend == "static" else None,
        master_port=cfg.static_master_port if cfg.rdzv_backend == "static" else None,
        local_addr=cfg.local_addr,
        event_log_handler=cfg.event_log_handler,
        numa_options=_numa_options(cfg.numa_binding),
        duplicate_stdout_filters=list(cfg.duplicate_stdout_filters) or None,
        duplicate_stderr_filters=list(cfg.duplicate_stderr_filters) or None,
        virtual_local_rank=cfg.virtual_local_rank,
    )
    logs_specs = _logs_specs_class(cfg.logs_specs_name)(
        log_dir=cfg.log_dir,
        redirects=Std.from_str(cfg.redirects),
        tee=Std.from_str(cfg.tee),
        local_ranks_filter=set(cfg.local_ranks_filter) if cfg.local_ranks_filter else None,
    )
    node_check = None
    if cfg.network_check and rdzv.check_handler is not None:
        from dlrover_torch.node_check import NodeCheckRound

        node_check = NodeCheckRound(
            rdzv.check_handler,
            timeout_seconds=cfg.node_check_timeout,
            straggler_ratio=cfg.straggler_ratio,
            exclude_straggler=cfg.exclude_straggler,
        )
    agent = DLRoverElasticAgent(
        spec,
        logs_specs,
        command=cfg.command,
        config=AgentConfig(
            hang=cfg.hang,
            spare_workers=cfg.spare_workers,
            spare_low_priority=cfg.spare_low_priority,
            python=cfg.python,
            lost_node_wait_seconds=float(cfg.rdzv_configs.get("lease_timeout", 10)) + 2.0,
        ),
        reporter=rdzv.reporter,
        node_check=node_check,
        start_method=cfg.start_method,
        exit_barrier_timeout=cfg.exit_barrier_timeout,
        log_line_prefix_template=cfg.log_line_prefix_template,
        shutdown_timeout=cfg.shutdown_timeout,
    )
    resources.closers.append(agent.close)
    if rdzv.job_client is not None:
        _start_heartbeats(rdzv.job_client, agent, resources)
    return agent


def _numa_options(mode: str | None) -> Any:
    """torchrun's --numa-binding as torch's NUMA options (None when not asked for)."""
    if mode is None:
        return None
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(mode))


def _logs_specs_class(name: str | None) -> type[LogsSpecs]:
    """torchrun's --logs-specs: a LogsSpecs class registered under `torchrun.logs_specs`."""
    if name is None:
        return DefaultLogsSpecs
    from importlib import metadata

    found = metadata.entry_points(group="torchrun.logs_specs").select(name=name)
    if not found:
        raise LaunchConfigError(
            f"--logs-specs {name!r}: no entry point of that name in group torchrun.logs_specs; "
            "install the package that provides it or drop the flag"
        )
    return next(iter(found)).load()


def report_failure(entrypoint: str, result: RunResult) -> None:
    """What torchrun reports for failed workers: its failures table with the root cause (the
    first failure), the root cause's error file copied to ours; then a one-line-per-rank
    summary."""
    error = ChildFailedError(name=entrypoint, failures=result.failures)
    _, root = error.get_first_failure()
    if root.error_file != _NOT_AVAILABLE:
        try:
            get_error_handler().dump_error_file(root.error_file, root.exitcode)
        except (OSError, ValueError) as e:
            log.warning("could not copy the root cause's error file %s: %s", root.error_file, e)
    print(f"{type(error).__module__}.{type(error).__name__}: {error}", file=sys.stderr)
    print(_summarize(result), file=sys.stderr)


def _summarize(result: RunResult) -> str:
    lines = ["dlrover-run: the workers failed:"]
    for rank, failure in sorted(result.failures.items()):
        message = failure.message
        if isinstance(message, dict):  # read from the worker's error file
            message = message.get("message", message)
        message = message if isinstance(message, str) else str(message)
        lines.append(
            f"  global rank {rank} (local rank {failure.local_rank}, pid {failure.pid}): "
            f"exit code {failure.exitcode}; {message.strip()[:400]}"
        )
    return "\n".join(lines)


def _prepare_process_env(cfg: LaunchConfig) -> None:
    """The few variables dlrover-run sets for itself and its workers, all here at the entry."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle  # read by torch's PContext
    if cfg.omp_num_threads and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = cfg.omp_num_threads
    if not cfg.uses_master:
        # torch's c10d rendezvous would otherwise hand its own TCP store to the workers; a
        # restarted group then can reach a stale address and hang in init_process_group.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


# -- flash checkpoint (dlrover_torch/checkpoint): the agent owns the node's checkpoint shared
# memory and persists it in the background and before a worker group is stopped.


def _start_flash_checkpoint(resources: _Resources) -> Any:
    """Start the node's checkpoint keeper; workers find it through DLROVER_CKPT_SERVICE."""
    from dlrover_torch.checkpoint import AgentCheckpointKeeper

    keeper = AgentCheckpointKeeper()
    os.environ.update(keeper.start())  # at the entry point, before any worker or spare starts
    resources.closers.append(keeper.close)
    return keeper


def _usage_error(error: LaunchConfigError) -> int:
    """Say what is wrong with the launch, torchrun-style, then as an exception line: a job's
    master takes an exception before the first step as a start-up error and fails at once."""
    print(f"dlrover-run: error: {error}", file=sys.stderr)
    print(f"{type(error).__name__}: dlrover-run: {error}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _say_replaced(cfg: LaunchConfig, reporter: AgentReporter) -> None:
    """Once per node: which torchrun rendezvous flags and PET_* variables the master replaced."""
    if cfg.replaced:
        reporter.event(
            "launcher_flags_replaced",
            f"this job's master runs the rendezvous; replaced: {', '.join(cfg.replaced)}",
            replaced=list(cfg.replaced),
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the dlrover-run console script."""
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        format="[dlrover-run %(asctime)s %(levelname)s] %(message)s",
    )
    get_error_handler().initialize()  # as torchrun's @record: faulthandler into our error file
    try:
        cfg, _ = config_from_args(argv, os.environ)
    except LaunchConfigError as e:
        return _usage_error(e)
    _prepare_process_env(cfg)
    resources = _Resources()
    try:
        keeper = _start_flash_checkpoint(resources)
        agent = build_agent(cfg, os.environ, resources)
        agent.on_stop.append(keeper.stop_hook)
        agent.start_spares()
        result = agent.run(cfg.role)
    except NodeExcludedError as e:
        print(f"dlrover-run: {e}", file=sys.stderr)
        return EXIT_EXCLUDED
    except LaunchConfigError as e:
        return _usage_error(e)
    except SignalException as e:
        # torchrun lets the SignalException end the process: exit status 1 for any signal.
        print(f"dlrover-run: stopped by {e.sigval.name}; the workers were stopped", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:
        from master.client import MasterError

        if isinstance(e, MasterError):
            print(f"dlrover-run: error: {e}", file=sys.stderr)
            return EXIT_FAILED
        raise
    finally:
        resources.close()
    if result is None:  # torch: the rendezvous was closed and the agent exited gracefully
        return 0
    if result.is_failed():
        report_failure(cfg.command.target, result)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
