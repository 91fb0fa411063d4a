"""dlrover-run flags: every torchrun flag with its meaning, plus the dlrover ones, as a config."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch.distributed.run import get_args_parser

from dlrover_torch.hang import HangConfig
from dlrover_torch.torchrun_env import (
    DLROVER_BACKEND,
    UsageError,
    apply_pet_env,
    parse_under_master,
    raise_usage_errors,
)
from dlrover_torch.worker_pool import WorkerCommand

ENV_MASTER_ADDR = "DLROVER_MASTER_ADDR"
ENV_NODE_RANK = "DLROVER_NODE_RANK"
ENV_NODE_TYPE = "DLROVER_NODE_TYPE"


class LaunchConfigError(ValueError):
    """A flag or environment variable has a value dlrover-run cannot use; the message says why."""


def under_job_master(env: Mapping[str, str]) -> bool:
    """Whether a dlrover job's master started this node (its rendezvous is then the master's)."""
    return bool(env.get(ENV_NODE_TYPE) and env.get(ENV_MASTER_ADDR))


@dataclass(frozen=True)
class LaunchConfig:
    """Everything dlrover-run needs to start its agent, built once from argv and the env."""

    command: WorkerCommand
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = "none"
    role: str = "default"
    rdzv_backend: str = DLROVER_BACKEND
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    node_rank: int = 0
    node_rank_given: bool = False
    static_master_addr: str = "127.0.0.1"
    static_master_port: int | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    event_log_handler: str = "null"
    shutdown_timeout: int = 30
    no_python: bool = False
    run_path: bool = False
    python: str = sys.executable
    omp_num_threads: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    numa_binding: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    virtual_local_rank: bool = False
    logs_specs_name: str | None = None
    # dlrover's own
    master_addr: str = ""
    network_check: bool = False
    node_unit: int = 1
    exclude_straggler: bool = False
    straggler_ratio: float = 2.0
    node_check_timeout: float = 60.0
    hang: HangConfig = field(default_factory=HangConfig)
    spare_workers: bool = True
    spare_low_priority: bool = True
    exit_barrier_timeout: float = 300.0
    # torchrun flags and PET_* variables replaced by the job master's rendezvous, as given
    replaced: tuple[str, ...] = ()

    @property
    def uses_master(self) -> bool:
        """Whether rendezvous and the workers' store go through the dlrover master."""
        return self.rdzv_backend == DLROVER_BACKEND


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """torchrun's parser (same flags, same PET_* env defaults, from `env` when given) with the
    dlrover flags added."""
    parser = get_args_parser()
    parser.prog = "dlrover-run"
    parser.description = (
        "Elastic launcher for PyTorch: a drop-in for torchrun backed by the dlrover master "
        "(rendezvous, store, hang detection, node checks, fast restarts from spare workers)."
    )
    for action in parser._actions:
        if action.dest == "rdzv_backend":
            action.default = (env or os.environ).get("PET_RDZV_BACKEND", DLROVER_BACKEND)
            action.help = (
                f"Rendezvous backend: '{DLROVER_BACKEND}' (default: the dlrover master) or a "
                "torch backend such as c10d or static."
            )
        if action.dest == "master_addr":
            action.help = (
                "HOST:PORT of the dlrover master (also DLROVER_MASTER_ADDR). A bare HOST keeps "
                "torchrun's meaning: the rank-0 address for --rdzv-backend static."
            )
    group = parser.add_argument_group("dlrover")
    group.add_argument(
        "--dlrover-master",
        default="",
        help="HOST:PORT of the dlrover master (same as --master-addr HOST:PORT).",
    )
    group.add_argument(
        "--network-check",
        action="store_true",
        help="Run a node check (compute and all-reduce timing) before training.",
    )
    group.add_argument(
        "--node-unit",
        type=int,
        default=1,
        help="A rendezvous round admits a multiple of this many nodes.",
    )
    group.add_argument(
        "--exclude-straggler",
        action="store_true",
        help="With --network-check: a straggling node leaves the job (faulty ones always do).",
    )
    group.add_argument(
        "--straggler-ratio",
        type=float,
        default=2.0,
        help="A node is a straggler when its check takes this many times the median.",
    )
    group.add_argument(
        "--node-check-timeout",
        type=float,
        default=60.0,
        help="Seconds a node check may take before the node counts as faulty.",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        default=300.0,
        help="Restart the workers after this many seconds without progress (0: never).",
    )
    group.add_argument(
        "--hang-cpu-percent",
        type=float,
        default=1.0,
        help="Scripts that report no steps: a worker below this CPU%% for the whole hang "
        "timeout counts as hung (0: only step reports count).",
    )
    group.add_argument(
        "--no-spare-workers",
        action="store_true",
        help="Start each worker as a fresh process instead of from a spare with torch imported.",
    )
    group.add_argument(
        "--spare-priority",
        choices=("low", "normal"),
        default="low",
        help="CPU priority of spare workers while they import (low: they never slow the "
        "training; normal: they are warm sooner when every core is busy).",
    )
    group.add_argument(
        "--exit-barrier-timeout",
        type=float,
        default=300.0,
        help="Seconds a finished node waits for the others at the end.",
    )
    return parser


def _split_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return n, n
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise LaunchConfigError(f"--nnodes {value!r}: give N or MIN:MAX with integers, e.g. 2 or 1:4")


def _parse_rdzv_conf(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise LaunchConfigError(
                f"--rdzv-conf {value!r}: {item!r} is not KEY=VALUE; "
                "use e.g. --rdzv-conf last_call_timeout=1,join_timeout=600"
            )
        out[key.strip()] = val.strip()
    return out


def _nproc(value: str) -> int:
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    if value == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise LaunchConfigError("--nproc-per-node gpu: no CUDA device here; give a number")
        return torch.cuda.device_count()
    try:
        n = int(value)
    except ValueError:
        raise LaunchConfigError(
            f"--nproc-per-node {value!r}: give a number, or one of auto, cpu, gpu"
        ) from None
    if n <= 0:
        raise LaunchConfigError(f"--nproc-per-node {value}: must be at least 1")
    return n


def config_from_args(
    argv: Sequence[str] | None, env: Mapping[str, str]
) -> tuple[LaunchConfig, argparse.Namespace]:
    """Parse argv (and the env it may name) into a LaunchConfig; LaunchConfigError if unusable.
    Under a job's master, torchrun's rendezvous flags and PET_* variables are replaced."""
    parser = build_parser(env)
    raise_usage_errors(parser)
    replaced: tuple[str, ...] = ()
    try:
        apply_pet_env(parser, env)
        if under_job_master(env):
            args, replaced = parse_under_master(parser, argv, env, env[ENV_MASTER_ADDR])
        else:
            args = parser.parse_args(argv)
    except UsageError as e:
        raise LaunchConfigError(str(e)) from None
    min_nodes, max_nodes = _split_nnodes(args.nnodes)
    if not 0 < min_nodes <= max_nodes:
        raise LaunchConfigError(
            f"--nnodes {args.nnodes}: need 0 < MIN <= MAX (e.g. --nnodes 1:4), "
            f"got MIN={min_nodes}, MAX={max_nodes}"
        )
    if args.max_restarts < 0:
        raise LaunchConfigError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if args.monitor_interval <= 0:
        raise LaunchConfigError(f"--monitor-interval {args.monitor_interval}: must be above 0")
    if args.node_unit < 1:
        raise LaunchConfigError(f"--node-unit {args.node_unit}: must be at least 1")
    if args.node_unit > max_nodes:
        raise LaunchConfigError(
            f"--node-unit {args.node_unit} is above the most nodes (--nnodes {args.nnodes}): "
            "no round could ever close; lower --node-unit or raise MAX"
        )
    if args.hang_timeout < 0:
        raise LaunchConfigError(f"--hang-timeout {args.hang_timeout}: must be 0 (off) or more")
    if args.straggler_ratio <= 1:
        raise LaunchConfigError(f"--straggler-ratio {args.straggler_ratio}: must be above 1")
    if args.module and args.no_python:
        raise LaunchConfigError("--module and --no-python cannot be combined: drop one of them")
    if not args.training_script:
        raise LaunchConfigError("no training script given: dlrover-run [FLAGS] SCRIPT [ARGS...]")

    master_addr = args.dlrover_master or ""
    static_master_addr = args.master_addr
    if not master_addr and args.master_addr and ":" in args.master_addr:
        master_addr, static_master_addr = args.master_addr, "127.0.0.1"
    if not master_addr:
        master_addr = env.get(ENV_MASTER_ADDR, "")
    if master_addr and not _valid_addr(master_addr):
        raise LaunchConfigError(
            f"dlrover master address {master_addr!r} (--master-addr/--dlrover-master/"
            f"{ENV_MASTER_ADDR}) is not HOST:PORT; e.g. --master-addr 10.0.0.1:50051"
        )

    backend = args.rdzv_backend
    standalone = bool(args.standalone)
    if standalone and master_addr and backend == DLROVER_BACKEND:
        raise LaunchConfigError(
            "--standalone starts a local master, but a master was also given "
            f"({master_addr}): drop --standalone or the master address"
        )
    if backend == DLROVER_BACKEND and not master_addr and max_nodes > 1:
        raise LaunchConfigError(
            f"--nnodes {args.nnodes} with no dlrover master: pass --master-addr HOST:PORT "
            f"(or set {ENV_MASTER_ADDR}), or use --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        )
    endpoint = args.rdzv_endpoint
    if standalone and backend != DLROVER_BACKEND:
        backend, endpoint = "c10d", "localhost:0"
    if backend == "static" and not endpoint:
        endpoint = f"{args.master_addr}:{args.master_port}"
    if backend not in (DLROVER_BACKEND, "static") and not endpoint:
        raise LaunchConfigError(
            f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (or use --standalone)"
        )

    ranks = None
    if args.local_ranks_filter:
        try:
            ranks = frozenset(int(r) for r in args.local_ranks_filter.split(","))
        except ValueError:
            raise LaunchConfigError(
                f"--local-ranks-filter {args.local_ranks_filter!r}: give local ranks like 0,1"
            ) from None

    node_rank = args.node_rank
    given = list(sys.argv[1:] if argv is None else argv)
    node_rank_given = any(a.split("=")[0] in ("--node-rank", "--node_rank") for a in given)
    if env.get(ENV_NODE_RANK):
        node_rank, node_rank_given = int(env[ENV_NODE_RANK]), True
    nproc = _nproc(args.nproc_per_node)
    command = WorkerCommand(
        target=args.training_script,
        args=tuple(args.training_script_args),
        module=bool(args.module),
        executable=bool(args.no_python),
    )
    if not args.module and not args.no_python and not os.path.exists(args.training_script):
        raise LaunchConfigError(
            f"training script {args.training_script!r} not found (cwd {os.getcwd()}); "
            "pass a path, or -m MODULE for a module"
        )
    omp = env.get("OMP_NUM_THREADS") or ("1" if nproc > 1 else None)
    config = LaunchConfig(
        command=command,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=args.rdzv_id,
        role=args.role,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=_parse_rdzv_conf(args.rdzv_conf),
        standalone=standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        node_rank=node_rank,
        node_rank_given=node_rank_given,
        static_master_addr=static_master_addr,
        static_master_port=args.master_port,
        local_addr=args.local_addr,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=ranks,
        log_line_prefix_template=env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        event_log_handler=args.event_log_handler,
        shutdown_timeout=_shutdown_timeout(args.shutdown_timeout, env),
        no_python=bool(args.no_python),
        run_path=bool(args.run_path),
        python=env.get("PYTHON_EXEC", sys.executable),
        omp_num_threads=omp,
        master_addr=master_addr,
        network_check=bool(args.network_check),
        node_unit=args.node_unit,
        exclude_straggler=bool(args.exclude_straggler),
        straggler_ratio=args.straggler_ratio,
        node_check_timeout=args.node_check_timeout,
        hang=HangConfig(timeout_seconds=args.hang_timeout, idle_cpu_percent=args.hang_cpu_percent),
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters or ()),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters or ()),
        numa_binding=args.numa_binding,
        signals_to_handle=args.signals_to_handle,
        virtual_local_rank=bool(args.virtual_local_rank),
        logs_specs_name=args.logs_specs,
        # numactl wraps a fresh process's command line, which a spare cannot have
        spare_workers=not (args.no_spare_workers or args.no_python or args.numa_binding),
        spare_low_priority=args.spare_priority == "low",
        exit_barrier_timeout=args.exit_barrier_timeout,
        replaced=replaced,
    )
    return config, args


def _shutdown_timeout(flag: int | None, env: Mapping[str, str]) -> int:
    """--shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s (as torchrun)."""
    if flag is not None:
        return flag
    value = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        return int(value)
    except ValueError:
        raise LaunchConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value!r}: give whole seconds, e.g. 30"
        ) from None


def _valid_addr(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
