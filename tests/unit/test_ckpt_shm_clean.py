"""Leases and the sweep of ownerless flash-checkpoint memory: real tmpfs, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from dlrover_torch.checkpoint import lease, shm, shm_clean
from dlrover_torch.checkpoint.checkpointer import standalone_namespace

HOLDER = """
import sys
from dlrover_torch.checkpoint import lease
held = lease.Lease.take(sys.argv[1], lease.owner_info("standalone", dir="x"))
print("held" if held else "busy", flush=True)
sys.stdin.readline()
"""


def _files(directory: str) -> list[str]:
    """Slot files and lease files under ``directory``."""
    leases = lease.lease_dir(directory)
    extra = os.listdir(leases) if os.path.isdir(leases) else []
    return sorted([n for n in os.listdir(directory) if not n.startswith(".")] + extra)


def _slots(directory: str, namespace: str, rank: int = 0) -> list[str]:
    paths = []
    for slot in range(2):
        path = shm.slot_path(namespace, rank, slot, directory)
        with open(path, "wb") as fh:
            fh.write(b"\0" * 8192)
        paths.append(path)
    return paths


def test_a_namespace_names_the_checkpoint_dir_and_leases_are_not_slots(tmp_path):
    ns = standalone_namespace(str(tmp_path / "my run"))
    assert ns.startswith(f"dlrover-fc-{os.getuid()}-my_run-")
    assert ns != standalone_namespace(str(tmp_path / "other" / "my run"))
    paths = _slots(str(tmp_path), ns)
    held = lease.Lease.take(lease.lease_path(ns, 0, str(tmp_path)), {"pid": os.getpid()})
    assert held is not None
    assert shm.slot_paths(ns, str(tmp_path)) == paths  # the lease file is not a slot
    held.release(remove=True)


def test_a_held_group_stays_and_an_orphan_goes_after_its_grace(tmp_path):
    d = str(tmp_path)
    mine, dead = "dlrover-fc-1-live-aaa", "dlrover-fc-1-dead-bbb"
    live_paths = _slots(d, mine)
    dead_paths = _slots(d, dead)
    held = lease.Lease.take(lease.lease_path(mine, 0, d), {"pid": os.getpid()})
    assert held is not None
    groups = {g.namespace: g for g in shm_clean.sweep(d, grace_s=60.0)}
    assert groups[mine].state == "held"
    assert groups[dead].state == "orphaned"  # stamped now, kept for a restart
    assert all(os.path.exists(p) for p in live_paths + dead_paths)
    stamp = lease.read_info(lease.lease_path(dead, 0, d))["orphaned_at"]
    assert isinstance(stamp, float)
    # a later sweep counts the grace from the first stamp, not from its own start
    with open(lease.lease_path(dead, 0, d), "w") as fh:
        json.dump({"orphaned_at": stamp - 61.0}, fh)
    groups = {g.namespace: g for g in shm_clean.sweep(d, grace_s=60.0)}
    assert groups[dead].state == "removed" and groups[mine].state == "held"
    assert not any(os.path.exists(p) for p in dead_paths)
    assert not os.path.exists(lease.lease_path(dead, 0, d))
    assert all(os.path.exists(p) for p in live_paths)
    held.release(remove=True)


def test_a_lease_held_by_a_live_process_protects_until_it_is_killed(tmp_path):
    d = str(tmp_path)
    ns = "dlrover-fc-1-proc-ccc"
    paths = _slots(d, ns)
    path = lease.lease_path(ns, 0, d)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        assert lease.Lease.take(path, {}) is None  # a second owner cannot take it
        (group,) = shm_clean.sweep(d, grace_s=0.0, remove_persisted=True)
        assert group.state == "held" and group.owner.get("pid") == proc.pid
        assert all(os.path.exists(p) for p in paths)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    (group,) = shm_clean.sweep(d, grace_s=0.0)
    assert group.state == "removed"
    assert _files(d) == []


def test_gc_keeps_orphans_in_their_grace_and_now_frees_them(tmp_path, capsys):
    d = str(tmp_path)
    ns = "dlrover-fc-1-cli-ddd"
    _slots(d, ns, rank=3)
    assert shm_clean.main(["ls", "--shm-dir", d]) == 0
    out = capsys.readouterr().out
    assert f"orphaned  {ns} rank 3  2 slot(s)" in out and "1 group(s)" in out
    assert shm_clean.main(["gc", "--shm-dir", d]) == 0
    assert "freed 0 B (0 group(s)); 1 group(s) kept" in capsys.readouterr().out
    assert len(_files(d)) == 3  # two slots and the stamped lease
    assert shm_clean.main(["gc", "--now", "--shm-dir", d]) == 0
    assert "freed 16.00 KiB (1 group(s))" in capsys.readouterr().out
    assert _files(d) == []
