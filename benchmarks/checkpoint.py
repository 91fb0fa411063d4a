"""Flash checkpoint: training-blocking save time, durable commit time and restore time.

By default, for state dicts of 0.5 and 2 GiB (16 MiB float32 tensors plus small optimizer-like
entries), the time a save blocks training: our first save without ``prepare()``, the second
(which may wait for the slots reserved in the background), warm saves; ``torch.save`` of the
same state to the same disk; and DLRover 0.6.1's flash checkpoint (first and warm saves, from
the anchors environment ``make anchors`` builds, run in the same run; skipped, and said so,
when it is missing).

``--full`` adds, in this process tree and on the same disk:

- floor: copying the same tensors into a preallocated, pre-touched buffer;
- ``Checkpointer.save(storage="memory")`` and ``save(storage="disk")``: time until it returns
  (every call, the first included, after ``prepare``), and for disk the time until ``wait()``
  says the checkpoint is durable; a cold first save without ``prepare`` is reported too;
- ``torch.save`` (with and without fsync), ``torch.distributed.checkpoint.async_save``'s
  blocking time, a raw write + fdatasync of the same bytes (the disk's write time);
- restore: ``load()`` from memory in this process, from disk (checksums verified), beside
  ``torch.load``; and crash to restored in a new process: a saver process is SIGKILLed after a
  memory save, then a spare process (torch already imported, as dlrover-run's spare workers
  are) or a cold new interpreter loads it.

Every system's first save starts from cold memory, as a job's first checkpoint does: the state
is built, then the benchmark waits ``--settle`` seconds (5) before the save. On a VM whose freed
memory goes back to the host (virtio-balloon free page reporting, as here) memory freed in the
last seconds is warm and memory freed earlier costs seconds per GiB to touch again, so without
the wait whichever system runs right after another frees memory wins its first save.

Ends with one JSON line. ``--sizes 0.5,1`` picks sizes; ``--json-only`` prints only the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_START = time.perf_counter()
import torch  # noqa: E402
from common import use_checkout  # noqa: E402

use_checkout()

import anchors  # noqa: E402
from ckpt_state import make_state, state_bytes  # noqa: E402

from dlrover_torch.checkpoint import AgentCheckpointKeeper, Checkpointer  # noqa: E402
from dlrover_torch.checkpoint import shm as shm_mod  # noqa: E402

IMPORT_S = time.perf_counter() - _START  # importing torch + dlrover in this process

GIB = 1 << 30
WARM_SAVES = 5


def say(msg: str) -> None:
    """Progress line (suppressed with --json-only)."""
    if not ARGS.json_only:
        print(msg, flush=True)


def timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def first_save(size_gib: float, root: str) -> dict[str, Any]:
    """What a training loop's saves block for, ours without prepare() beside torch.save and
    DLRover's first flash save, one after the other on the same machine."""
    state = make_state(int(size_gib * GIB))
    res: dict[str, Any] = {"size_gib": size_gib, "tensor_bytes": state_bytes(state)}
    ck = Checkpointer(os.path.join(root, f"first-{size_gib}"))
    ck._service_process()  # its persister is up, as in a job whose first save comes later
    time.sleep(ARGS.settle)
    res["first_save_no_prepare_s"] = timed(ck.save, 1, state, "memory")
    res["second_save_s"] = timed(ck.save, 2, state, "memory")
    warm = [timed(ck.save, step, state, "memory") for step in range(3, 3 + WARM_SAVES)]
    res["warm_save_median_s"] = statistics.median(warm)
    # The warm saves above may overlap the other slot's background reservation (fresh memory
    # touched for seconds on this VM); once it is done, saves alternate two touched slots.
    ck.prepare(state)
    steady = [timed(ck.save, step, state, "memory") for step in range(10, 10 + WARM_SAVES)]
    res["steady_save_median_s"] = statistics.median(steady)
    ck.close()
    tpath = os.path.join(root, "first-torch.pt")
    time.sleep(ARGS.settle)
    saves = [torch_save(state, f"{tpath}.{i}", False) for i in range(2)]
    for i in range(2):
        os.unlink(f"{tpath}.{i}")
    res["torch_save_first_s"], res["torch_save_best_s"] = saves[0], min(saves)
    del state
    res["dlrover"] = dlrover_flash_save(size_gib, root)
    d = res["dlrover"]
    res["first_vs_torch_save"] = res["torch_save_first_s"] / res["first_save_no_prepare_s"]
    if d.get("first_save_s"):
        res["first_vs_dlrover_first"] = d["first_save_s"] / res["first_save_no_prepare_s"]
    say(
        f"[{size_gib} GiB] first save without prepare() {res['first_save_no_prepare_s']:.3f} s, "
        f"second {res['second_save_s']:.3f} s, warm {res['warm_save_median_s']:.3f} s "
        f"(once both slots are reserved {res['steady_save_median_s']:.3f} s); "
        f"torch.save {res['torch_save_first_s']:.3f} s (best {res['torch_save_best_s']:.3f} s) "
        f"-> {res['first_vs_torch_save']:.1f}x less; DLRover {anchors.DLROVER_VERSION}: "
        + (
            f"first {d['first_save_s']:.3f} s, second {d['second_save_s']:.3f} s, "
            f"warm {d['warm_save_median_s']:.3f} s"
            if d.get("first_save_s")
            else d.get("skipped", "not measured")
        )
    )
    return res


def dlrover_flash_save(size_gib: float, root: str, attempts: int = 2) -> dict[str, Any]:
    """DLRover's flash checkpoint on the same state, in the anchors' interpreter. Its saver's
    start-up sometimes never finishes here: such a run is killed after 180 s and tried again."""
    exe = anchors.python()
    if exe is None:
        return {"skipped": anchors.MISSING}
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [exe, os.path.join(here, "anchor_flash_save.py"), str(size_gib)]
    cmd += [os.path.join(root, f"dlrover-{size_gib}"), str(2 + WARM_SAVES), str(ARGS.settle)]
    hung = 0
    for _ in range(attempts):
        out = _run_anchor(cmd)
        if out is None:
            hung += 1
            continue
        try:
            doc = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"skipped": "DLRover's flash save failed", "hung": hung}
        times = doc["save_s"]
        return {
            "version": anchors.DLROVER_VERSION,
            "first_save_s": times[0],
            "second_save_s": times[1],
            "warm_save_median_s": statistics.median(times[2:]),
            "returned": doc["returned"],
            "hung_attempts": hung,
        }
    return {"skipped": f"DLRover's flash save hung {hung} time(s) (killed after 180 s)"}


def _run_anchor(cmd: list[str]) -> str | None:
    """Run one DLRover save child in a session of its own; its stdout, None if it hung."""
    for stale in ("/tmp/ckpt_sock",):  # DLRover's fixed socket dir: stale sockets make it wait
        shutil.rmtree(stale, ignore_errors=True)
    # A file, not a pipe: DLRover's saver process inherits the child's stdout and keeps a pipe
    # open after the child exited.
    out_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        cmd,
        stdout=out_file,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        proc.wait(timeout=180)
        out_file.seek(0)
        out: str | None = out_file.read()
    except subprocess.TimeoutExpired:
        out = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its saver process lives in the session
        except ProcessLookupError:
            pass
        proc.wait()
        for name in os.listdir("/dev/shm"):
            if name.startswith("ckpt_shm_"):  # DLRover's segment (fixed names)
                shm_mod.unlink_quietly(os.path.join("/dev/shm", name))
        shutil.rmtree("/tmp/ckpt_sock", ignore_errors=True)
        out_file.close()
    return out


class FloorCopy:
    """Copy every tensor into views of one preallocated, pre-touched buffer (the floor)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tensors = list(state["model"].values())
        self.buf = torch.empty(sum(t.numel() * 4 for t in self.tensors), dtype=torch.uint8)
        self.buf.fill_(1)  # pre-touch
        self.views, off = [], 0
        for t in self.tensors:
            nb = t.numel() * 4
            self.views.append(self.buf[off : off + nb].view(torch.float32))
            off += nb

    def once(self) -> float:
        """One timed copy."""
        start = time.perf_counter()
        for v, t in zip(self.views, self.tensors, strict=True):
            v.copy_(t)
        return time.perf_counter() - start


def raw_disk_write(state: dict[str, Any], path: str) -> float:
    """Write the same bytes with os.write, then fdatasync: the disk's write time."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for t in state["model"].values():
        view = memoryview(t.numpy()).cast("B")
        while len(view):
            view = view[os.write(fd, view) :]
    os.fdatasync(fd)
    os.close(fd)
    return time.perf_counter() - start


def torch_save(state: dict[str, Any], path: str, fsync: bool) -> float:
    """torch.save's blocking time (optionally until durable)."""
    start = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save(state, fh)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    return time.perf_counter() - start


def dcp_async(state: dict[str, Any], path: str) -> tuple[float, float]:
    """torch.distributed.checkpoint.async_save: (blocking time, time until done)."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    fut = dcp.async_save({"model": state["model"]}, checkpoint_id=path)
    blocked = time.perf_counter() - start
    fut.result()
    return blocked, time.perf_counter() - start


def drop_cache(path: str) -> None:
    """Evict one file from the page cache (only this file; other work is not affected)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_now() -> float:
    """CPU seconds of this process (all threads)."""
    return time.process_time()


def measure(size_gib: float, root: str) -> dict[str, Any]:
    """Every figure for one state size."""
    nbytes = int(size_gib * GIB)
    state = make_state(nbytes)
    total = state_bytes(state)
    res: dict[str, Any] = {"size_gib": size_gib, "tensor_bytes": total}
    floor = FloorCopy(state)
    floor_times = [floor.once() for _ in range(2)]  # warm up

    ckdir = os.path.join(root, f"ck-{size_gib}")
    ck = Checkpointer(ckdir, keep_latest=2)
    start = time.perf_counter()
    ck.prepare(state)
    res["prepare_s"] = time.perf_counter() - start
    # Interleave floor copies and saves so both see the same machine load.
    floor_times, mem_times, cpu_save, mem_cpu = [], [], 0.0, []
    floor_cpu = 0.0
    for step in range(1, 7):
        cpu0 = cpu_now()
        floor_times.append(floor.once())
        floor_cpu += cpu_now() - cpu0
        cpu0 = cpu_now()
        start = time.perf_counter()
        ck.save(step, state, "memory")
        mem_times.append(time.perf_counter() - start)
        mem_cpu.append(cpu_now() - cpu0)
        cpu_save += mem_cpu[-1]
    res["floor_copy_s"] = statistics.median(floor_times)
    res["floor_copy_all_s"] = floor_times
    res["memory_save_cpu_s"] = cpu_save / len(mem_times)
    res["floor_copy_cpu_s"] = floor_cpu / len(mem_times)
    res["memory_save_s"] = mem_times
    res["memory_save_cpu_each_s"] = mem_cpu
    res["memory_save_first_s"] = mem_times[0]
    res["memory_save_max_ratio"] = max(mem_times) / res["floor_copy_s"]
    res["memory_save_median_ratio"] = statistics.median(mem_times) / res["floor_copy_s"]
    # CPU time is steadier than wall time on a shared machine: the save's CPU against the
    # floor copy's, every call.
    res["memory_save_max_cpu_ratio"] = max(mem_cpu) / res["floor_copy_cpu_s"]
    say(
        f"[{size_gib} GiB] floor copy median {res['floor_copy_s']:.3f} s; save(memory) first "
        f"{mem_times[0]:.3f} s, max {max(mem_times):.3f} s, median "
        f"{statistics.median(mem_times):.3f} s -> max {res['memory_save_max_ratio']:.2f}x "
        f"floor, CPU max {res['memory_save_max_cpu_ratio']:.2f}x the floor's "
        f"(prepare {res['prepare_s']:.3f} s, once, before the loop)"
    )
    del floor

    cold_dir = os.path.join(root, f"cold-{size_gib}")
    cold = Checkpointer(cold_dir)
    start = time.perf_counter()
    cold.save(1, state, "memory")
    res["cold_first_save_no_prepare_s"] = time.perf_counter() - start
    cold.close()
    say(
        f"[{size_gib} GiB] a first save without prepare(): "
        f"{res['cold_first_save_no_prepare_s']:.3f} s"
    )

    raw = [raw_disk_write(state, os.path.join(root, "raw.bin")) for _ in range(2)]
    os.unlink(os.path.join(root, "raw.bin"))
    res["disk_write_s"] = min(raw)
    disk_block, durable, persist, floor_disk = [], [], [], []
    floor = FloorCopy(state)
    for step in range(10, 13):
        floor_disk.append(floor.once())
        start = time.perf_counter()
        ck.save(step, state, "disk")
        disk_block.append(time.perf_counter() - start)
        ck.wait()
        durable.append(time.perf_counter() - start)
        persist.append(ck.persist_reports[-1])
    res["disk_save_block_s"] = disk_block
    res["disk_save_block_max_ratio"] = max(disk_block) / statistics.median(floor_disk)
    del floor
    res["durable_commit_s"] = min(durable)
    res["durable_commit_ratio"] = res["durable_commit_s"] / res["disk_write_s"]
    res["persist_service_s"] = min(float(r["seconds"]) for r in persist)
    res["persist_cpu_s"] = statistics.median(float(r["cpu_seconds"]) for r in persist)
    say(
        f"[{size_gib} GiB] save(disk) blocks max {max(disk_block):.3f} s; durable in "
        f"{res['durable_commit_s']:.3f} s vs raw write+fdatasync {res['disk_write_s']:.3f} s "
        f"-> {res['durable_commit_ratio']:.2f}x (persister CPU {res['persist_cpu_s']:.2f} s)"
    )

    start = time.perf_counter()
    step, loaded = ck.load()
    res["restore_memory_in_process_s"] = time.perf_counter() - start
    assert step == 12 and torch.equal(
        loaded["model"]["layer0.weight"], state["model"]["layer0.weight"]
    )
    del loaded
    ck.close()  # removes the memory copy: the next load reads disk, verifying checksums
    for name in os.listdir(os.path.join(ckdir, "step-12")):
        drop_cache(os.path.join(ckdir, "step-12", name))
    ck2 = Checkpointer(ckdir)
    ck2._service_process()  # its persister process has started (not part of a load)
    start = time.perf_counter()
    step, loaded = ck2.load()
    res["restore_disk_s"] = time.perf_counter() - start
    assert step == 12
    del loaded
    ck2.close()

    tpath = os.path.join(root, "torch.pt")
    res["torch_save_s"] = min(torch_save(state, tpath, False) for _ in range(2))
    res["torch_save_fsync_s"] = min(torch_save(state, tpath, True) for _ in range(2))
    start = time.perf_counter()
    loaded = torch.load(tpath, weights_only=True)
    res["torch_load_s"] = time.perf_counter() - start
    del loaded
    drop_cache(tpath)
    start = time.perf_counter()
    loaded = torch.load(tpath, weights_only=True)
    res["torch_load_cold_s"] = time.perf_counter() - start
    del loaded
    os.unlink(tpath)
    dcp_runs = [dcp_async(state, os.path.join(root, f"dcp{i}")) for i in range(2)]
    res["dcp_async_block_s"] = min(b for b, _ in dcp_runs)
    res["dcp_async_total_s"] = min(t for _, t in dcp_runs)
    for i in range(2):
        shutil.rmtree(os.path.join(root, f"dcp{i}"), ignore_errors=True)
    say(
        f"[{size_gib} GiB] torch.save {res['torch_save_s']:.3f} s ({res['torch_save_fsync_s']:.3f}"
        f" s with fsync); dcp.async_save blocks {res['dcp_async_block_s']:.3f} s; restore: "
        f"memory {res['restore_memory_in_process_s']:.3f} s, disk {res['restore_disk_s']:.3f} s"
        f" (not in page cache), torch.load {res['torch_load_s']:.3f} s warm / "
        f"{res['torch_load_cold_s']:.3f} s not cached"
    )
    del state
    res.update(crash_restore(size_gib, root))
    shutil.rmtree(ckdir, ignore_errors=True)
    return res


def crash_restore(size_gib: float, root: str) -> dict[str, float]:
    """SIGKILL a saver after a memory save; time until a spare / a cold process has restored."""
    ckdir = os.path.join(root, f"crash-{size_gib}")
    me = [sys.executable, os.path.abspath(__file__)]
    # As under dlrover-run: this process plays the agent (it owns the shm and the persister).
    keeper = AgentCheckpointKeeper(f"bench-{os.getpid()}")
    env = {**os.environ, **keeper.start()}
    saver = subprocess.Popen(
        me + ["--child-save", ckdir, str(size_gib)], stdout=subprocess.PIPE, text=True, env=env
    )
    spare = subprocess.Popen(
        me + ["--child-restore", ckdir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    out: dict[str, float] = {}
    try:
        assert saver.stdout.readline().strip() == "saved"
        assert spare.stdout.readline().strip() == "ready"
        killed = time.time()
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        spare.stdin.write("go\n")
        spare.stdin.flush()
        doc = json.loads(spare.stdout.readline())
        out["crash_to_restored_spare_s"] = doc["restored_at"] - killed
        out["restore_load_call_s"] = doc["load_s"]
        spare.wait()
        start = time.time()
        cold = subprocess.run(
            me + ["--child-restore", ckdir, "--no-wait"], capture_output=True, text=True, env=env
        )
        doc = json.loads(cold.stdout.strip().splitlines()[-1])
        out["crash_to_restored_cold_s"] = doc["restored_at"] - start
        out["cold_import_s"] = doc["import_s"]
    finally:
        for proc in (saver, spare):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        keeper.close()  # removes the shm, as the agent does when it exits
        shutil.rmtree(ckdir, ignore_errors=True)
    say(
        f"[{size_gib} GiB] crash -> restored (agent-owned shm): "
        f"{out['crash_to_restored_spare_s']:.3f} s with a spare process "
        f"(load() {out['restore_load_call_s']:.3f} s), "
        f"{out['crash_to_restored_cold_s']:.3f} s with a cold interpreter "
        f"(of which importing torch {out['cold_import_s']:.3f} s)"
    )
    return out


def child_save(ckdir: str, size_gib: float) -> None:
    """Training process that saves to memory and then waits to be killed."""
    state = make_state(int(size_gib * GIB), seed=1)
    ck = Checkpointer(ckdir)
    ck.prepare(state)
    ck.save(1, state, "memory")
    print("saved", flush=True)
    time.sleep(3600)


def child_restore(ckdir: str, wait: bool, import_s: float) -> None:
    """Spare (or cold) process: load the checkpoint and report when it was restored."""
    if wait:
        print("ready", flush=True)
        sys.stdin.readline()
    start = time.perf_counter()
    ck = Checkpointer(ckdir)
    found = ck.load()
    load_s = time.perf_counter() - start
    restored_at = time.time()
    assert found is not None and found[0] == 1, "nothing restored"
    ck.close(remove_memory=False)
    print(json.dumps({"restored_at": restored_at, "load_s": load_s, "import_s": import_s}))


def fits(size_gib: float, full: bool) -> bool:
    """Memory for the state, its copies and two shm slots: about 7x the state with --full
    (restores hold more copies), 3.5x for the saves alone (the state, two slots, and DLRover's
    state and segment after ours are freed; torch.save's page cache can be reclaimed)."""
    avail = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    shm_free = shm_mod.shm_free_bytes()
    return size_gib * GIB * (7 if full else 3.5) < avail and size_gib * GIB * 2.2 < shm_free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,2", help="GiB, comma separated")
    parser.add_argument("--full", action="store_true", help="also persistence and restore")
    parser.add_argument("--dir", default=None, help="scratch dir on the disk to measure")
    parser.add_argument("--json-only", action="store_true")
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds before each system's first save"
    )
    parser.add_argument("--child-save", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--child-restore", help=argparse.SUPPRESS)
    parser.add_argument("--no-wait", action="store_true", help=argparse.SUPPRESS)
    global ARGS
    ARGS = parser.parse_args()
    if ARGS.child_save:
        child_save(ARGS.child_save[0], float(ARGS.child_save[1]))
        return
    if ARGS.child_restore:
        child_restore(ARGS.child_restore, not ARGS.no_wait, IMPORT_S)
        return
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM runs the cleanup in the finally blocks (child processes, shm, scratch files).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = tempfile.mkdtemp(prefix="dlrover-ckpt-bench-", dir=ARGS.dir)
    load0 = os.getloadavg()
    firsts, results, notes = [], [], []
    try:
        for size in [float(s) for s in ARGS.sizes.split(",")]:
            run = size
            while not fits(run, ARGS.full) and run > 0.25:
                run /= 2
            if run != size:
                note = f"{size} GiB does not fit in memory / /dev/shm here; measured {run} GiB"
                notes.append(note)
                say("NOTE: " + note)
            firsts.append(first_save(run, root))
            if ARGS.full:
                results.append(measure(run, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    targets = {
        "first_save_3x_below_torch_save": all(r["first_vs_torch_save"] >= 3 for r in firsts),
        "first_save_at_most_dlrover_first": (
            all(r["first_vs_dlrover_first"] >= 1 for r in firsts)
            if all("first_vs_dlrover_first" in r for r in firsts)
            else None  # DLRover not measured
        ),
        "second_save_at_most_dlrover_second": (
            all(r["second_save_s"] <= r["dlrover"]["second_save_s"] for r in firsts)
            if all(r["dlrover"].get("second_save_s") for r in firsts)
            else None
        ),
    }
    if results:
        targets.update(
            {
                "memory_save_within_2x_floor": all(
                    r["memory_save_max_ratio"] <= 2 for r in results
                ),
                "memory_save_cpu_within_2x_floor": all(
                    r["memory_save_max_cpu_ratio"] <= 2 for r in results
                ),
                "disk_save_block_within_2x_floor": all(
                    r["disk_save_block_max_ratio"] <= 2 for r in results
                ),
                "durable_commit_within_1_5x_disk": all(
                    r["durable_commit_ratio"] <= 1.5 for r in results
                ),
                "crash_to_restored_1gib_under_1s_spare": all(
                    r["crash_to_restored_spare_s"] < 1 for r in results if r["size_gib"] == 1
                ),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "first_save": firsts,
                "results": results,
                "targets": targets,
                "notes": notes,
                # load averages (1, 5, 15 min) at start and end; 2 cores here
                "loadavg_start_end": [load0, os.getloadavg()],
                "cores": os.cpu_count(),
            }
        )
    )


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
