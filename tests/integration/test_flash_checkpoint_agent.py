"""Flash checkpoint under dlrover-run: a killed rank restarts from the agent's memory copy."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_torch.checkpoint import shm, storage
from tests.integration.dlrover_run_helpers import REPO, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
EXAMPLE = str(REPO / "examples" / "torch" / "flash_ckpt_train.py")


def train(tmp_path, name, *extra):
    events = tmp_path / f"{name}.jsonl"
    argv = [EXAMPLE, "--ckpt-dir", str(tmp_path / name), "--steps", "16", "--disk-every", "100"]
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    out = run_launcher(flags, [*argv, "--events", str(events), *extra], 180)
    assert out.returncode == 0, out.stdout[-4000:]
    return [json.loads(line) for line in events.read_text().splitlines()], out.stdout


def ours():
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"dlrover-fc-{os.getuid()}-agent")}


def test_killed_rank_restarts_from_memory_and_matches_an_uninterrupted_run(tmp_path):
    before = ours()
    evs, log = train(tmp_path, "killed", "--kill-at-step", "7")
    restored = [e for e in evs if e["event"] == "restored"]
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == [
        (0, 7, "memory"),
        (1, 7, "memory"),
    ], log[-3000:]
    # disk saves only every 100 steps: step 7 reached disk because the agent persisted the
    # latest memory checkpoint before it stopped the failed group.
    root = str(tmp_path / "killed")
    assert storage.is_complete(storage.step_dir(root, 7))
    assert storage.read_tracker(root) >= 7
    reference, _ = train(tmp_path, "clean")
    digest = {e["rank"]: e["params"] for e in evs if e["event"] == "done"}
    want = {e["rank"]: e["params"] for e in reference if e["event"] == "done"}
    assert digest == want and len(want) == 2  # resumed training is bit-identical
    assert ours() == before  # the agent removed its shared memory on exit
