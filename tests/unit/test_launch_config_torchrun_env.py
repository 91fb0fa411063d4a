"""torchrun's flags and PET_* variables under dlrover-run: honoured as torchrun honours them,
the rendezvous ones replaced (and named) under a job's master; launcher errors fail at once."""

from __future__ import annotations

import json

import pytest
from torch.distributed.run import get_args_parser

from dlrover_torch import run
from dlrover_torch.launch_config import LaunchConfigError, config_from_args
from dlrover_torch.reporting import AgentReporter
from dlrover_torch.torchrun_env import MASTER_OWNED
from master.job.diagnosis import diagnose_exit

SCRIPT = __file__
JOB = {"DLROVER_NODE_TYPE": "worker", "DLROVER_MASTER_ADDR": "m:5", "DLROVER_NODE_RANK": "1"}


def cfg(*argv: str, env: dict | None = None):
    return config_from_args(list(argv), env or {})[0]


@pytest.mark.parametrize(
    "flags, replaced",
    [
        (["--rdzv_backend=c10d"], ["--rdzv-backend c10d"]),
        (["--rdzv-backend", "c10d"], ["--rdzv-backend c10d"]),
        (
            ["--rdzv_backend", "etcd", "--rdzv_endpoint=etcd:2379"],
            ["--rdzv-backend etcd", "--rdzv-endpoint etcd:2379"],
        ),
        (
            ["--rdzv-backend=c10d", "--rdzv-endpoint", "w0:29400", "--rdzv_id=job-7"],
            ["--rdzv-backend c10d", "--rdzv-endpoint w0:29400", "--rdzv-id job-7"],
        ),
        (
            ["--rdzv-backend=static", "--master_addr", "10.0.0.9", "--master-port=29501"],
            ["--rdzv-backend static", "--master-addr 10.0.0.9", "--master-port 29501"],
        ),
        (["--standalone"], ["--standalone"]),
        (["--node_rank=3"], ["--node-rank 3"]),
        (["--rdzv-backend", "dlrover", "--master-addr", "m:5"], []),  # the master's own values
    ],
)
def test_under_a_job_the_rendezvous_flags_give_way_to_the_masters(flags, replaced):
    c = cfg("--nnodes", "1:2", *flags, SCRIPT, "--rdzv_backend", "c10d", env=JOB)
    assert c.uses_master and c.master_addr == "m:5" and c.rdzv_endpoint == ""
    assert (c.run_id, c.node_rank, c.standalone) == ("none", 1, False)
    assert list(c.replaced) == replaced
    assert (c.min_nodes, c.max_nodes) == (1, 2)
    assert c.command.args == ("--rdzv_backend", "c10d")  # the script's own arguments untouched


def test_under_a_job_pet_variables_are_flag_defaults_but_the_master_owns_the_rendezvous():
    env = dict(JOB, PET_NNODES="1:2", PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="3")
    env |= {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "w0:29400", "PET_RDZV_ID": "j"}
    c = cfg(SCRIPT, env=env)
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.max_restarts) == (1, 2, 2, 3)
    assert c.uses_master and c.rdzv_endpoint == "" and c.run_id == "none"
    assert c.replaced == ("PET_RDZV_BACKEND=c10d", "PET_RDZV_ENDPOINT=w0:29400", "PET_RDZV_ID=j")
    # a flag wins over its PET_* variable, as in torchrun
    assert cfg("--nproc_per_node=4", SCRIPT, env=env).nproc_per_node == 4


def test_outside_a_job_pet_variables_are_honoured_as_torchrun_does():
    env = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "h:29400", "PET_NPROC_PER_NODE": "3"}
    c = cfg(SCRIPT, env=env | {"PET_RDZV_ID": "run9", "PET_MAX_RESTARTS": "2"})
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("c10d", "h:29400", "run9")
    assert (c.nproc_per_node, c.max_restarts, c.replaced) == (3, 2, ())
    s = cfg(SCRIPT, env={"PET_STANDALONE": "1", "PET_RDZV_BACKEND": "c10d"})
    assert (s.standalone, s.rdzv_endpoint) == (True, "localhost:0")
    # the master's address alone (not a job node) keeps an explicit torch backend
    t = cfg("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", SCRIPT, env={"X": "1"})
    assert (t.rdzv_backend, t.replaced) == ("c10d", ())


def test_the_values_the_master_takes_are_torchruns_defaults():
    defaults = {a.dest: a.default for a in get_args_parser()._actions}
    for dest, (_, value) in MASTER_OWNED.items():
        if dest != "rdzv_backend":
            assert defaults[dest] == value, dest


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["--rdzv_bakend=c10d", SCRIPT], {}, "unrecognized arguments: --rdzv_bakend=c10d"),
        (["--nnodes"], JOB, "argument --nnodes: expected one argument"),
        (["--max-restarts", "many", SCRIPT], {}, "--max_restarts: invalid int value"),
        ([SCRIPT], {"PET_STANDALONE": "yes"}, "PET_STANDALONE='yes'"),
        (["./no_such_echo.py"], JOB, "'./no_such_echo.py' not found"),
    ],
)
def test_launcher_errors_are_start_up_errors_the_master_fails_at_once(argv, env, needle, capsys):
    assert run._usage_error(_error(argv, env)) == run.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("dlrover-run: error: ") and needle in err, err
    found = diagnose_exit(run.EXIT_USAGE, "some start-up output\n" + err, started=False)
    assert found.deterministic and needle in found.summary, found


def _error(argv: list[str], env: dict) -> LaunchConfigError:
    try:
        cfg(*argv, env=env)
    except LaunchConfigError as e:
        return e
    raise AssertionError("no error")


class DictKV:
    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value


def test_what_was_replaced_is_said_once_to_the_log_and_the_master(caplog):
    kv = DictKV()
    reporter = AgentReporter("none", 1, kv)
    run._say_replaced(cfg("--rdzv_backend=c10d", "--rdzv-id", "x", SCRIPT, env=JOB), reporter)
    run._say_replaced(cfg(SCRIPT, env=JOB), reporter)  # nothing replaced: nothing said
    assert len(kv.data) == 1
    event = json.loads(next(iter(kv.data.values())))
    assert event["kind"] == "launcher_flags_replaced"
    assert event["replaced"] == ["--rdzv-backend c10d", "--rdzv-id x"]
    said = [r.getMessage() for r in caplog.records if "replaced:" in r.getMessage()]
    assert len(said) == 1 and "--rdzv-backend c10d, --rdzv-id x" in said[0], said
