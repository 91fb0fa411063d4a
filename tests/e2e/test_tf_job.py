"""The TF example job on real processes: a worker SIGKILLed mid-epoch, nothing lost."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS, EPOCHS, BATCH = 24_000, 2, 128

pytestmark = pytest.mark.slow


def write_job(tmp_path, records=RECORDS, eval_records=2048, script="wide_deep.py", args=None):
    """job.yaml for an example of examples/tf (1 ps, chief, 2 workers) logging trained ids;
    `args` replace the example's --eval-records. Returns the ids folder."""
    ids = tmp_path / "ids"
    ids.mkdir()
    job = {
        "name": script.split(".")[0].replace("_", "-") + "-e2e",
        "command": [
            "python",
            os.path.join(ROOT, "examples", "tf", script),
            "--records",
            str(records),
            "--epochs",
            str(EPOCHS),
            "--batch-size",
            str(BATCH),
            *(["--eval-records", str(eval_records)] if args is None else args),
            "--log-trained-ids",
            str(ids / "trained"),
        ],
        "workdir": str(tmp_path),
        "ps": {"replicas": 1},
        "chief": {"replicas": 1},
        "worker": {"replicas": 2, "max_relaunches": 2},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return ids


def check_trained_ids(ids, records, extra_batches):
    files = glob.glob(str(ids / "trained.*.ids"))
    trained = np.concatenate([np.fromfile(f, dtype=np.int64) for f in files])
    counts = np.bincount(trained, minlength=records)
    assert len(counts) == records, "a trained id outside the dataset"
    assert counts.min() == EPOCHS, f"{int((counts < EPOCHS).sum())} records trained too few times"
    extra = int((counts - EPOCHS).sum())
    limit = extra_batches * BATCH
    assert extra <= limit, f"{extra} records trained more than {EPOCHS} times (limit {limit})"
    return files


def _events(run_dir, *kinds):
    """The messages of the job's events of `kinds`, in order."""
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return [e["message"] for e in events if e["kind"] in kinds]


def run_worker_kill_job(tmp_path, *args, records=RECORDS, env=None, edit=None):
    """The example (`edit(job)` changes its YAML) with worker 1 SIGKILLed at 40%; checks the
    summary and the trained ids. Returns (summary, the submit's output)."""
    ids = write_job(tmp_path, records=records, eval_records=1024)
    if edit is not None:
        job = yaml.safe_load((tmp_path / "job.yaml").read_text())
        edit(job)
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml"), *args]
    cmd += ["--kill", "worker:1@40%", "--summary-json", str(summary_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    assert summary["datasets"]["train"]["records_done"] == records * EPOCHS
    faults = _events(summary["run_dir"], "fault", "fault_waiting")
    # Relaunched; on a loaded machine the others may finish the data before the relaunch
    # (a Ray actor importing TF) trains, and it is then stopped with the job, not failed.
    _check_relaunched(summary, ("worker", 1), "killed", faults)
    assert all(n["status"] == "deleted" for n in summary["nodes"] if n["type"] == "ps")
    # The hung step never ran (a hang costs no batch twice); the killed one may have.
    files = check_trained_ids(ids, records, extra_batches=1)
    assert len(files) >= 3, files  # chief, worker 0, worker 1 (and its relaunch if it trained)
    return summary, proc.stdout


def _check_relaunched(summary, node, reason, why):
    """The node's first incarnation ended for `reason` and its one relaunch ended well."""
    incarnations = [n for n in summary["nodes"] if (n["type"], n["rank"]) == node]
    assert incarnations[0]["exit_reason"] == reason and len(incarnations) == 2, why
    last = incarnations[-1]
    assert last["status"] == "succeeded" or last["exit_reason"] == "stopped", incarnations


def test_tf_killed_and_hung_workers_are_relaunched_with_exact_record_accounting(tmp_path):
    """Worker 1 SIGKILLed at 40% of the records, and worker 0 hung at its 40th step with its
    heartbeats going on, in one job: both are relaunched, the hung step's batch and the rest of
    its shard go back to the queue, and every record is trained."""

    def hang_worker_0(job):
        job["command"] += ["--rehearse-hang", "worker:0:40"]
        job["hang_timeout_seconds"] = 15

    summary, out = run_worker_kill_job(tmp_path, edit=hang_worker_0)
    assert "made no step for 15s; restarting it" in out, out[-4000:]
    _check_relaunched(summary, ("worker", 0), "hang", out[-4000:])
    assert [n["exit_reason"] for n in summary["nodes"]].count("hang") == 1


def _scale(addr, token_file, target):
    cmd = [sys.executable, "-m", "master.cli", "scale", target]
    cmd += ["--addr", addr, "--token-file", token_file]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_tf_workers_scale_2_3_1_while_training(tmp_path):
    # Worker 2 is added once the job trains. A TF process starting beside busy ones takes
    # 10-25 s on 2 cores, and meanwhile the others trained the data out (seen under load:
    # worker 2 came up after the job's 9 s of training). So the chief and workers 0 and 1 are
    # frozen at global step 100 until worker 2 has trained, and go on beside it; their
    # heartbeats stop meanwhile, so the job's heartbeat timeout is longer than the freeze.
    records = 2 * RECORDS

    def reserve_slots(job):
        job["worker"]["reserve_slots"] = True  # TF_CONFIG lists the slots workers are added in
        job["heartbeat_timeout_seconds"] = 300

    proc, run_dir, client, ids = _start_at_step(tmp_path, 1, records=records, edit=reserve_slots)
    try:
        addr = (tmp_path / "submit.out").read_text().split("master at ")[1].split(",")[0]
        token_file = str(run_dir / ".job_token")
        trainers = _trainer_pids(run_dir, ("chief", 0), ("worker", 0), ("worker", 1))
        _wait_for_step(client, 100, proc)
        with _freezing() as freeze:
            freeze(*trainers)
            assert "worker: 2 -> 3" in _scale(addr, token_file, "worker=3")
            _wait_until(lambda: _files_grew(ids, "worker.2"), proc, "a step of worker 2", 300)
        assert "worker: 3 -> 1" in _scale(addr, token_file, "worker=1")
        proc.wait(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, (tmp_path / "submit.out").read_text()[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["datasets"]["train"]["records_done"] == records * EPOCHS
    workers = [n for n in summary["nodes"] if n["type"] == "worker"]
    assert {n["rank"] for n in workers if n["status"] == "deleted"} == {1, 2}
    # Two workers were stopped mid-epoch: at most one batch each trained twice.
    check_trained_ids(ids, records, extra_batches=2)


def test_tf_ps_kill_rolls_data_back_to_the_restored_checkpoint(tmp_path):
    records = 2 * RECORDS  # 750 steps: checkpoints at 0, 200, 400 and 600
    ids = write_job(tmp_path, records=records, args=_checkpoint_every(200))
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--kill", "ps:0@step=500", "--summary-json", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    rollback = [e for e in summary["events"] if e["kind"] == "rollback"]
    assert len(rollback) == 1, summary["events"]
    details = rollback[0]["details"]
    redo, ckpt_step = details["records_to_redo"], details["checkpoint_step"]
    # The chief checkpoints every 200 steps; async workers move the global step on. The kill
    # fires when the master sees step 500, and its view trails the steps by up to a second of
    # them (coalesced reports; seen: 605-627 at 200 steps/s), so the kill may come after the
    # checkpoint near 600. The rollback goes to the checkpoint restored: the newest one saved
    # before the kill (the one before it if the kill cut its save short), or the save the chief
    # makes right after restoring it.
    kill = next(e for e in summary["events"] if e["kind"] == "fault")
    saved = _checkpoints_saved_before(Path(summary["run_dir"]) / "model", kill["time"])
    # (A chief starved of CPU may not have saved since step 0: then 0 is the one restored.)
    assert saved and redo > 0, (saved, rollback)
    low = saved[-2] if len(saved) > 1 else saved[-1]  # older ones may be pruned (keep 5)
    assert low <= ckpt_step < saved[-1] + 200, (saved, rollback)
    # A periodic save is not coordinated (README): its data position is saved just before the
    # saver reads the variables, so the steps workers take in between are in the restored model
    # and their batches go again (seen under load: model.ckpt-541 holding global step 657, its
    # position saved at 541, 116 steps trained twice).
    during_save = ckpt_step - details["position_step"]
    assert 0 <= during_save < 200, rollback
    steps = records * EPOCHS // BATCH
    # The model applied every batch once but for those: its global step climbs to the total (a
    # few more when workers flush short batches while they wait for others' last shards). Read
    # from the chief's final checkpoint: the master's last report may trail it (seen in CI: 748
    # reported, model.ckpt-751).
    top = steps * 1.02 + 3 + during_save
    final = _checkpoint_in(Path(summary["run_dir"]) / "model")
    assert steps <= final <= top, (final, summary["global_step"], rollback)
    trained = np.concatenate(
        [np.fromfile(f, dtype=np.int64) for f in glob.glob(str(ids / "trained.*.ids"))]
    )
    counts = np.bincount(trained, minlength=records)
    assert counts.min() == EPOCHS
    extra = int((counts - EPOCHS).sum())
    # Trained twice: exactly what was rolled back, up to one in-flight batch per trainer.
    assert abs(extra - redo) <= 3 * BATCH, (extra, redo)


def test_tf_ps_job_survives_its_master_being_killed_mid_epoch(tmp_path):
    """The same story with the state on etcd runs with the fake trainer: test_master_restart.py's
    test_master_killed_with_its_state_on_etcd_resumes_from_etcd."""
    ids = write_job(tmp_path, eval_records=1024)
    summary_path = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--kill", "master:0@40%", "--summary-json", str(summary_path)]
    out = _submit_with_stacks_on_hang(cmd, tmp_path / "submit.out")
    assert "master died (killed by SIGKILL); restarting it" in out
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "succeeded"
    assert summary["datasets"]["train"]["records_done"] == RECORDS * EPOCHS
    # No healthy node was relaunched: one incarnation per node, none failed.
    assert sorted((n["type"], n["rank"], n["relaunches"]) for n in summary["nodes"]) == [
        ("chief", 0, 0),
        ("ps", 0, 0),
        ("worker", 0, 0),
        ("worker", 1, 0),
    ]
    assert "master_restarted" in [e["kind"] for e in summary["events"]]
    # No node died, so no record was trained more than `epochs` times.
    check_trained_ids(ids, RECORDS, extra_batches=0)


def _checkpoint_every(steps, eval_records=1024):
    """The example's flags for a checkpoint every `steps` steps (its default is 500)."""
    return ["--eval-records", str(eval_records), "--checkpoint-steps", str(steps)]


def _submit_with_stacks_on_hang(cmd, out_path, timeout=480.0):
    """Run `dlrover submit`; its output (asserted to have succeeded). A job still running
    after `timeout` (under the test's own limit) is asked for its master's thread stacks
    (SIGUSR1) before it is killed, and fails the test showing them (seen once under load:
    the restarted master never ended the job after its training was done)."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(_master_child(proc.pid), signal.SIGUSR1)
            time.sleep(2)
            tail = out_path.read_text()[-12000:]
            raise AssertionError(f"no end after {timeout:.0f} s:\n{tail}") from None
        finally:
            proc.kill()
            proc.wait()
    text = out_path.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _start_at_step(tmp_path, step=150, retry_seconds=5.0, records=RECORDS, edit=None):
    """The example job (`edit(job)` changes its YAML) submitted in the background (its output
    in submit.out), returned once its global step reached `step`: (process, run dir, client
    of its master, ids dir)."""
    from master.client import MasterClient, read_token

    ids = write_job(tmp_path, records=records, eval_records=1024)
    if edit is not None:
        job = yaml.safe_load((tmp_path / "job.yaml").read_text())
        edit(job)
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--run-dir", str(run_dir), "--summary-json", str(tmp_path / "s.json")]
    out = open(tmp_path / "submit.out", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        while "master at " not in (first := (tmp_path / "submit.out").read_text()):
            assert proc.poll() is None, first
            time.sleep(0.1)
        addr = first.split("master at ")[1].split(",")[0]
        token = read_token({"DLROVER_JOB_TOKEN_FILE": str(run_dir / ".job_token")})
        client = MasterClient(addr, token, retry_seconds=retry_seconds)
        _wait_for_step(client, step, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, run_dir, client, ids


def _wait_for_step(client, step, proc):
    _wait_until(lambda: client.job_status().global_step >= step, proc, f"global step {step}")


def _finished_summary(proc, tmp_path, records=RECORDS):
    """Waits for the job; its summary, checked to have succeeded with every record trained."""
    try:
        proc.wait(timeout=600)
    finally:
        proc.kill()
    out = (tmp_path / "submit.out").read_text()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["datasets"]["train"]["records_done"] == records * EPOCHS
    return summary, out


def _check_exact_rollback(summary, ids, records=RECORDS):
    """Workers and chief paused at a step boundary for the checkpoint: nothing, or at most a
    report still on its way to the master, is trained again; and the trained ids are every
    record `epochs` times plus exactly what was rolled back, up to one batch a trainer."""
    redo = sum(
        e["details"].get("records_to_redo", 0) for e in summary["events"] if e["kind"] == "rollback"
    )
    assert redo <= 2 * BATCH, redo
    ids_files = glob.glob(str(ids / "trained.*.ids"))
    counts = np.bincount(
        np.concatenate([np.fromfile(f, dtype=np.int64) for f in ids_files]), minlength=records
    )
    assert counts.min() == EPOCHS
    assert abs(int((counts - EPOCHS).sum()) - redo) <= 3 * BATCH, redo


def test_tf_ps_migrates_to_more_memory_while_training(tmp_path):
    # Twice the data: the master's view of the step trails it by up to a second of steps, and
    # at 200 steps/s most of 375 steps may be trained once the master has seen step 150.
    records = 2 * RECORDS
    proc, _, client, ids = _start_at_step(tmp_path, records=records)
    try:
        reply = client.migrate("ps", 0, memory_mb=2048, reason="e2e")
    finally:
        summary, _ = _finished_summary(proc, tmp_path, records)
    assert reply.checkpoint_step >= 150
    ps = [n for n in summary["nodes"] if n["type"] == "ps"]
    assert [(n["id"], n["relaunches"]) for n in ps][1] == (reply.node_id, 0)  # not a failure
    kinds = [e["kind"] for e in summary["events"]]
    assert "migration" in kinds and "migrated" in kinds and "relaunch" not in kinds
    migrated = next(e for e in summary["events"] if e["kind"] == "migrated")
    assert "2048 MB" in migrated["message"]
    _check_exact_rollback(summary, ids, records)


def _master_child(submit_pid):
    """The master process a supervising `dlrover submit` runs."""
    import psutil

    for child in psutil.Process(submit_pid).children():
        if "--lifeline-fd" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError("no supervised master")


def _trainer_pids(run_dir, *nodes):
    """The pids of the nodes' training processes (not their orphan guards), found in one scan;
    `nodes` are (type, rank) pairs."""
    import psutil

    found = {}
    for p in psutil.process_iter():
        try:
            env, cmdline = p.environ(), p.cmdline()
        except psutil.Error:
            continue
        node = (env.get("DLROVER_NODE_TYPE"), env.get("DLROVER_NODE_RANK"))
        if (
            env.get("DLROVER_RUN_DIR") == str(run_dir)
            and node in {(t, str(r)) for t, r in nodes}
            and len(cmdline) > 1
            and cmdline[1].endswith("wide_deep.py")
        ):
            found[node] = p.pid
    missing = [f"{t}-{r}" for t, r in nodes if (t, str(r)) not in found]
    assert not missing, f"no process of {missing}"
    return [found[(t, str(r))] for t, r in nodes]


@contextlib.contextmanager
def _freezing():
    """`freeze(*pids)` stops processes (SIGSTOP); all go on (SIGCONT) when the block ends."""
    frozen = []

    def freeze(*pids):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

    try:
        yield freeze
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


def _wait_for_event(run_dir, kind, timeout=120.0):
    deadline = time.monotonic() + timeout
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and f'"kind": "{kind}"' in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event")


def test_tf_ps_count_1_to_2_while_training_with_the_master_killed_midway(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # Client retries carry the call over the master's restart. Twice the data: the master's
    # view of the step trails it by up to a second of steps (coalesced reports), and at 200
    # steps/s the chief alone once trained the rest of 375 steps before it was frozen.
    records = 2 * RECORDS
    proc, run_dir, client, ids = _start_at_step(
        tmp_path, step=1, retry_seconds=60.0, records=records
    )
    try:
        with ThreadPoolExecutor(1) as pool:
            # Every trainer is frozen: the chief cannot checkpoint, so the change stays in
            # progress until the master is killed (it may otherwise be done by then), and the
            # workers cannot train the data out meanwhile (unfrozen, they train the whole
            # dataset in 2-3 s; under load the change once began with 3% of it left). The
            # chief, which starts last, is frozen once it has trained a step (so it can
            # checkpoint when asked); the processes are found first (a scan takes a second).
            chief, *workers = _trainer_pids(run_dir, ("chief", 0), ("worker", 0), ("worker", 1))
            with _freezing() as freeze:
                _wait_for_step(client, 100, proc)
                freeze(*workers)
                _wait_until(lambda: _files_grew(ids, "chief"), proc, "a step of the chief", 120)
                freeze(chief)
                scaled = pool.submit(client.scale, "ps", 2, "e2e")
                # The change has begun (workers pausing, or the checkpoint asked for): the
                # master dies; the restarted one carries the change on from its saved record,
                # and the retried call joins it.
                _wait_for_event(run_dir, "ps_resize")
                os.kill(_master_child(proc.pid), signal.SIGKILL)
            reply = scaled.result(timeout=400)
    finally:
        summary, out = _finished_summary(proc, tmp_path, records)
    assert (reply.previous, reply.replicas) == (1, 2)
    assert "master died (killed by SIGKILL); restarting it" in out, out[-4000:]
    ps = [n for n in summary["nodes"] if n["type"] == "ps"]
    assert sorted((n["rank"], n["relaunches"]) for n in ps) == [(0, 0), (0, 0), (1, 0)]
    kinds = [e["kind"] for e in summary["events"]]
    assert "ps_resize" in kinds and "ps_resized" in kinds and "relaunch" not in kinds
    assert "master_restarted" in kinds
    resized = next(e for e in summary["events"] if e["kind"] == "ps_resized")
    assert resized["details"]["cluster_version"] > 1
    # The restarted chief built its variables over two PS and restored the checkpoint into them.
    chief_logs = sorted(glob.glob(str(run_dir / "logs" / "chief-0.*.log")))
    assert len(chief_logs) == 2, chief_logs
    before, after = (open(p).read() for p in chief_logs)
    assert "over 1 PS, up to 1 parts" in before
    assert "over 2 PS, up to 2 parts" in after
    assert f"model.ckpt-{resized['details']['checkpoint_step']}" in after
    _check_exact_rollback(summary, ids, records)


def _checkpoints_saved_before(model_dir, when: float) -> list[int]:
    """Steps of the model dir's checkpoints whose index file was written before `when` (a
    `time.time()`), oldest first; TF writes the index once the data files are complete."""
    steps = []
    for index in model_dir.glob("model.ckpt-*.index"):
        if index.stat().st_mtime < when:
            steps.append(int(index.name[len("model.ckpt-") : -len(".index")]))
    return sorted(steps)


def _checkpoint_in(model_dir) -> int:
    """The step of the newest checkpoint the model dir's state file names (-1: none yet)."""
    try:
        text = (model_dir / "checkpoint").read_text()
    except OSError:
        return -1
    match = re.search(r'^model_checkpoint_path: ".*-(\d+)"$', text, re.M)
    return int(match.group(1)) if match else -1


def _files_grew(ids, task) -> bool:
    return any(os.path.getsize(f) > 0 for f in glob.glob(str(ids / f"trained.{task}.*.ids")))


def _batches_trained(ids) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(str(ids / "trained.*.ids"))) // 8 // BATCH


def _ps_server_pid(run_dir) -> int:
    """The pid of the job's PS server process (`python -m dlrover_tf.ps`, not its guard)."""
    want = f"DLROVER_RUN_DIR={os.path.realpath(run_dir)}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        ps_server = argv[1:3] == [b"-m", b"dlrover_tf.ps"]
        if ps_server and want in env and b"DLROVER_NODE_TYPE=ps" in env:
            return int(pid)
    raise AssertionError(f"no PS process of {run_dir}")


def _wait_until(condition, proc, what, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.05)


def _records_since(ids, restored: int, killed: float) -> tuple[int, int]:
    """Records trained before the PS was killed (at time `killed`) on steps past global step
    `restored`, and the highest global step reached before the kill (from each trainer's
    PATH.steps file: global step, records, end time of each step)."""
    since, reached = 0, 0
    for path in glob.glob(str(ids / "trained.*.ids.steps")):
        rows = np.fromfile(path, dtype="<i8").reshape(-1, 3)
        # A step ending within 0.5 s of the kill ran before it: rebuilding the sessions
        # on a new PS and restoring the checkpoint take longer.
        before = rows[rows[:, 2] < (killed + 0.5) * 1e6]
        since += int(before[before[:, 0] > restored, 1].sum())
        reached = max(reached, int(before[:, 0].max(initial=0)))
    return since, reached


def test_tf_ps_kill_without_elastic_model_fn_the_data_follows_the_restored_checkpoint(tmp_path):
    # The program uses only the sharded input and the documented ShardProgressHook (no
    # elastic_model_fn, no CheckpointLedgerListener): the hook alone tells the master of each
    # checkpoint the chief saves and of the step the chief's session restored.
    # 2,250 steps (checkpoints at 0, 200, 400, ...): the kill comes 150 steps past the first
    # checkpoint after 0, with a good margin before the end even if the chief trains alone (a
    # worker that finds the chief not ready at its first check sleeps TF's 30 s; the chief
    # alone trains up to ~200 steps/s here), or starts late: its checkpoints come only with its
    # own steps, and its first step trails the workers' by 1-2 s, once (in CI) by more than the
    # 6 s the two workers took to train all 1,125 steps of half this data.
    records = 6 * RECORDS
    ids = write_job(tmp_path, records=records, args=_checkpoint_every(200))
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job["command"].append("--progress-hook-only")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "master.cli", "submit", str(tmp_path / "job.yaml")]
    cmd += ["--summary-json", str(tmp_path / "s.json"), "--run-dir", str(run_dir)]
    with open(tmp_path / "submit.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            # The PS is SIGKILLed while the trainers train (a worker that slept TF's 30 s may
            # still be asleep), 150 steps after a checkpoint past step 0.
            _wait_until(lambda: _checkpoint_in(run_dir / "model") > 0, proc, "a checkpoint")
            saved = _checkpoint_in(run_dir / "model")
            _wait_until(lambda: _batches_trained(ids) >= saved + 150, proc, f"step {saved + 150}")
            os.kill(_ps_server_pid(run_dir), signal.SIGKILL)
            killed = time.time()
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    # The step TF restored: the first checkpoint the chief loaded (the final evaluation loads
    # the last one too).
    chief_log = "".join(open(p).read() for p in glob.glob(str(run_dir / "logs" / "chief-0.*")))
    loaded = [
        int(line.split("model.ckpt-")[1].split()[0])
        for line in chief_log.splitlines()
        if "Restoring parameters from " in line and "model.ckpt-" in line
    ]
    assert loaded and loaded[0] >= saved, (loaded, saved)
    restored = loaded[0]
    # The checkpoint named `restored` holds the variables as the saver read them, a few steps
    # later under load (seen: model.ckpt-501 holding global step 508): the records of those
    # steps are in the restored model. Its own global step is what the chief's session read
    # right after the restore (the line after TF's "Restoring parameters").
    lines = chief_log.splitlines()
    at = next(
        i
        for i, line in enumerate(lines)
        if "Restoring parameters from " in line and f"model.ckpt-{restored}" in line
    )
    model_step = next(
        int(line.split("model loaded at global step ")[1].split(";")[0])
        for line in lines[at:]
        if "model loaded at global step " in line
    )
    assert model_step >= restored, (model_step, restored)
    since, reached = _records_since(ids, restored, killed)
    model_lacks, _ = _records_since(ids, model_step, killed)
    trained = np.concatenate(
        [np.fromfile(f, dtype=np.int64) for f in glob.glob(str(ids / "trained.*.ids"))]
    )
    counts = np.bincount(trained, minlength=records)
    extra = int((counts - EPOCHS).sum())
    print(
        f"PS killed at global step {reached}; TF restored {restored} (the model at step "
        f"{model_step}); records trained since {since} ({model_lacks} the model lacks); "
        f"trained again {extra}"
    )
    assert counts.min() == EPOCHS, "a record trained too few times"
    # Exactly the records the restored model had not trained on go again, up to one batch in
    # flight per trainer: nothing the restored model lacks is skipped, and no more goes again
    # than was trained since the step the checkpoint's data position was saved at.
    assert model_lacks - 3 * BATCH <= extra <= since + 3 * BATCH, (
        extra,
        model_lacks,
        since,
        restored,
        model_step,
        reached,
    )
    rollback = [e for e in summary["events"] if e["kind"] == "rollback"]
    # The data went back to the position saved with the checkpoint TF restored (the step the
    # chief reports is the restored model's global step, which may be a little past it).
    assert [e["details"]["position_step"] for e in rollback] == [restored], rollback
    assert rollback[0]["reason"] == "model_restored", rollback
