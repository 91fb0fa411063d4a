"""dlrover-run's pure parts: flags and their errors, the hang detector, the node-check verdict."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from dlrover_torch.hang import HangConfig, HangDetector
from dlrover_torch.launch_config import DLROVER_BACKEND, LaunchConfigError, config_from_args
from dlrover_torch.node_check import ProbeResult, classify
from dlrover_torch.progress import StepReporter, read_progress

SCRIPT = __file__


def cfg(*argv: str, env: dict | None = None):
    return config_from_args(list(argv), env or {})[0]


def test_torchrun_flags_keep_their_meaning():
    c = cfg(
        "--nnodes=1:4",
        "--nproc_per_node",
        "3",
        "--max-restarts",
        "5",
        "--rdzv-id",
        "job7",
        "--role",
        "trainer",
        "--monitor-interval",
        "0.5",
        "--rdzv-conf",
        "last_call_timeout=2,join_timeout=30",
        "--master-addr",
        "10.0.0.1:50051",
        SCRIPT,
        "--lr",
        "0.1",
    )
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.max_restarts) == (1, 4, 3, 5)
    assert (c.run_id, c.role, c.monitor_interval) == ("job7", "trainer", 0.5)
    assert c.rdzv_configs == {"last_call_timeout": "2", "join_timeout": "30"}
    assert c.rdzv_backend == DLROVER_BACKEND and c.master_addr == "10.0.0.1:50051"
    assert c.command.target == SCRIPT and c.command.args == ("--lr", "0.1")
    assert c.omp_num_threads == "1"  # as torchrun: one thread per worker when several share a node


def test_master_from_env_module_mode_and_static_master_addr():
    c = cfg("-m", "pkg.train", env={"DLROVER_MASTER_ADDR": "m:1", "DLROVER_NODE_RANK": "2"})
    assert c.master_addr == "m:1" and c.command.module and c.command.target == "pkg.train"
    assert c.node_rank == 2 and c.node_rank_given
    # A bare host keeps torchrun's meaning (rank-0 address of the static rendezvous).
    s = cfg(
        "--rdzv-backend", "static", "--master-addr", "10.1.1.1", "--master-port", "29500", SCRIPT
    )
    assert s.master_addr == "" and s.rdzv_endpoint == "10.1.1.1:29500"


def test_standalone_with_a_torch_backend_is_torchruns_standalone():
    c = cfg("--standalone", "--rdzv-backend", "c10d", SCRIPT)
    assert (c.rdzv_backend, c.rdzv_endpoint) == ("c10d", "localhost:0")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nnodes", "3:2", SCRIPT], "--nnodes 3:2"),
        (["--nnodes", "two", SCRIPT], "--nnodes 'two'"),
        (["--nnodes", "2", SCRIPT], "--master-addr HOST:PORT"),
        (["--node-unit", "4", "--nnodes", "2", "--master-addr", "m:1", SCRIPT], "--node-unit 4"),
        (["--master-addr", "m:notaport", SCRIPT], "is not HOST:PORT"),
        (["--standalone", "--master-addr", "m:1", SCRIPT], "drop --standalone"),
        (["--rdzv-conf", "oops", SCRIPT], "--rdzv-conf"),
        (["--nproc-per-node", "zero", SCRIPT], "--nproc-per-node 'zero'"),
        (["--rdzv-backend", "c10d", SCRIPT], "--rdzv-endpoint"),
        (["/no/such/train.py"], "not found"),
        (["--hang-timeout", "-1", SCRIPT], "--hang-timeout"),
    ],
)
def test_bad_flags_name_the_flag_and_the_fix(argv, needle):
    with pytest.raises(LaunchConfigError) as e:
        cfg(*argv)
    assert needle in str(e.value)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hang_detector_uses_step_reports(tmp_path):
    clock = Clock()
    det = HangDetector(HangConfig(timeout_seconds=10), clock=clock, cpu_seconds=lambda pid: 0.0)
    files = {0: str(tmp_path / "p0"), 1: str(tmp_path / "p1")}
    det.reset({0: 1, 1: 2}, files)
    reporters = {r: StepReporter(path) for r, path in files.items()}
    for step in range(1, 4):
        for rep in reporters.values():
            rep.report(step)
        clock.now += 4
        assert det.check() is None
    reporters[0].report(4)  # rank 1 stops reporting
    clock.now += 9
    assert det.check() is None
    clock.now += 2
    reason = det.check()
    assert reason and reason.startswith("local rank 1 reported no step") and "last step 3" in reason
    assert det.last_steps() == {0: 4, 1: 3}
    assert read_progress(files[1]).step == 3


def test_hang_detector_without_reports_uses_cpu():
    clock = Clock()
    used = {7: 0.0, 8: 0.0}
    det = HangDetector(
        HangConfig(timeout_seconds=10, idle_cpu_percent=5),
        clock=clock,
        cpu_seconds=lambda pid: used[pid],
    )
    det.reset({0: 7, 1: 8}, {})
    for _ in range(12):  # rank 0 busy (50% of a core), rank 1 idle
        assert det.check() is None or clock.now - 100.0 >= 10
        clock.now += 1
        used[7] += 0.5
    reason = det.check()
    assert reason and reason.startswith("local rank 1 (pid 8) used 0.00% CPU")


def test_hang_detector_off():
    det = HangDetector(HangConfig(timeout_seconds=0), clock=Clock(), cpu_seconds=lambda p: 0.0)
    det.reset({0: 1}, {})
    assert det.check() is None


def test_node_check_verdict():
    ok = lambda r, c: ProbeResult(r, True, compute_seconds=c, allreduce_seconds=0.01)  # noqa: E731
    v = classify({0: ok(0, 1.0), 1: ok(1, 1.1), 2: ok(2, 3.5), 3: None}, 4, straggler_ratio=2.0)
    assert v.faulty == [3] and v.stragglers == [2] and v.median_compute_seconds == 1.1
    v = classify({0: ok(0, 1.0), 1: ProbeResult(1, False, error="boom")}, 2, 2.0)
    assert v.faulty == [1] and v.stragglers == []
    assert v.to_dict()["results"]["1"]["error"] == "boom"


def test_spares_warm_at_low_priority_unless_asked_otherwise():
    assert cfg(SCRIPT).spare_low_priority
    assert not cfg("--spare-priority", "normal", SCRIPT).spare_low_priority
    with pytest.raises(LaunchConfigError, match="--spare-priority: invalid choice: 'high'"):
        cfg("--spare-priority", "high", SCRIPT)


PROBE = """
import json, os, sys
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in names}, f)
"""


def _probe(tmp_path, launcher: list[str], tag: str, env: dict[str, str]) -> dict[str, dict]:
    """Run the probe under a launcher; the variables each rank saw, by rank."""
    from tests.integration.dlrover_run_helpers import REPO, base_env

    out = tmp_path / tag
    out.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run(
        [*launcher, str(script), str(out)],
        env=base_env(**env),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.timeout(300)
def test_torchruns_pet_variables_give_the_script_the_same_environment(tmp_path):
    """Parity probe: one script under torchrun and under dlrover-run, with the PET_* variables
    Kubeflow's operator sets and a c10d rendezvous; the script sees the same variables."""

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def pet() -> dict[str, str]:
        return {
            "PET_NNODES": "1",
            "PET_NPROC_PER_NODE": "2",
            "PET_MAX_RESTARTS": "3",
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
            "PET_RDZV_ID": "parity",
        }

    python = [sys.executable, "-m"]
    torchrun = _probe(tmp_path, [*python, "torch.distributed.run"], "torchrun", pet())
    ours = _probe(tmp_path, [*python, "dlrover_torch.run"], "dlrover", pet())
    assert sorted(torchrun) == sorted(ours) == ["0", "1"], (torchrun, ours)
    for rank in ("0", "1"):
        theirs, mine = dict(torchrun[rank]), dict(ours[rank])
        assert theirs.pop("MASTER_ADDR") and mine.pop("MASTER_ADDR")
        assert int(theirs.pop("MASTER_PORT")) > 0 and int(mine.pop("MASTER_PORT")) > 0
        assert mine == theirs, rank
        assert (mine["WORLD_SIZE"], mine["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")
        assert mine["TORCHELASTIC_RUN_ID"] == "parity"
