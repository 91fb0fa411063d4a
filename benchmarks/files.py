"""Records per second read through `ShardedDataset.from_files` against plain tf.data readers of
the same files, in the same run, and how fast the per-file indexes are built.

For each format the same records (a CTR-like example: a record id, 8 categorical ids, 4 dense
floats, a label) are written once into 8 files, then read in alternating rounds, the whole data
once per run, batch B, the same batched parse on both sides (2 parallel calls, 2 batches
prefetched, autotuning off on both):

- tfrecord: from_files(..., "tfrecord") vs `tf.data.TFRecordDataset(files).batch(B)`, both
  parsed by `tf.io.parse_example`;
- text: from_files(..., "text") vs `tf.data.TextLineDataset(files).batch(B)`, both parsed by
  `tf.io.decode_csv`;
- parquet: from_files(..., "parquet") vs pyarrow's own `ParquetFile.iter_batches(B)` fed through
  `tf.data.Dataset.from_generator`, columns as numpy arrays on both sides.

Ours takes its shards from a master in a child process (a JobMaster with SQLite state, the
sync gRPC server, one registered worker) and reports every batch as a training step would
(`step_done`), so the figure includes the shard asks and the progress reports (coalesced
through a position file, as on the local platform, Ray and Kubernetes under the pod guard).
A run's time is from the first `next()` to the batch holding its last record, on both sides
(ours then waits up to a second for the master to hear of the last steps, which a trainer
does not wait for). Each format's ratio is the median over rounds of ours / plain records
per second (the two sides alternate which goes first); its `_cpu_ratio` the same in records
per CPU second (this process's threads, and for ours also the master's), steadier than wall
time on a busy machine. The index figure is the
TFRecord index build (both CRCs of every record checked) in MB of file per second, cache off;
text and Parquet index times are shown too. `tfrecord_shuffled_ratio` is ours with
shuffle=True (blocks and windows) against the same plain, unshuffled pipeline.

Left out: a model (this is input alone; benchmarks/tf_hooks.py measures training); files on
remote or cold storage (the files are in the page cache after the first round, as on a warm
local disk; reading cold disks is the same for both sides); compressed TFRecord files (refused
by from_files); the plain side's own shuffling (`Dataset.shuffle` costs it per record); several
workers (one reader, one master).

    python benchmarks/files.py [--records 400000] [--batch 256] [--rounds 5] [--formats ...]

Prints a line per run, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

from common import ROOT, Child, cpu_seconds, use_checkout

use_checkout()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

log = logging.getLogger("bench-files")

FILES = 8
VOCAB = (5000, 3000, 2000, 1000, 500, 100, 50, 20)
DENSE = 4
ROWS_PER_GROUP = 65_536
MASTER_START_TIMEOUT_S = 120.0
FORMATS = ("tfrecord", "text", "parquet")


def master_main(conn, tmp_dir: str) -> None:
    """A child process serving one job's master (no node launched) until told to stop."""
    from master.config import parse_job_spec
    from master.job.master import JobMaster, JobRuntime
    from master.platform.local import LocalPlatform
    from master.rpc.server import start_server
    from master.state.sqlite import SQLiteStateStore

    try:
        spec = parse_job_spec(
            {"name": "bench-files", "command": ["true"], "worker": {"replicas": 1}},
            source="bench",
            base_dir=tmp_dir,
        )
        store = SQLiteStateStore(os.path.join(tmp_dir, "state.sqlite"))
        platform = LocalPlatform()
        job = JobMaster(spec, platform, store, JobRuntime(tmp_dir, "", ""))
        node = job.nodes.new_incarnation("worker", 0, 0, 0)
        job.nodes.mark_running(node.id, platform.address_for("worker", 0), "")
        token = secrets.token_urlsafe(16)
        server, port = start_server(job, "127.0.0.1", 0, token, 16, 2000)
    except BaseException as e:
        conn.send(("error", repr(e)))
        raise
    conn.send(("ready", port, token, node.id))
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    server.stop(grace=0).wait()
    job.sharding.close()
    platform.shutdown(0)
    store.close()


def columns(n0: int, n1: int) -> dict:
    """Records [n0, n1) as numpy columns (a pure function of the record id)."""
    import numpy as np

    ids = np.arange(n0, n1, dtype=np.int64)
    rng = np.random.default_rng(n0)
    cols = {"id": ids}
    for k, vocab in enumerate(VOCAB):
        cols[f"c{k}"] = (rng.random(len(ids)) ** 2 * vocab).astype(np.int64)
    for k in range(DENSE):
        cols[f"d{k}"] = rng.random(len(ids)).astype(np.float32)
    cols["label"] = (rng.random(len(ids)) < 0.25).astype(np.float32)
    return cols


def write_data(folder: str, records: int, formats: tuple[str, ...]) -> dict[str, list[str]]:
    """The records as 8 files of each format; their paths by format."""
    import numpy as np
    import tensorflow as tf

    paths: dict[str, list[str]] = {f: [] for f in formats}
    per_file = -(-records // FILES)
    for f in range(FILES):
        cols = columns(f * per_file, min(records, (f + 1) * per_file))
        names = list(cols)
        if "tfrecord" in formats:
            path = os.path.join(folder, f"part-{f}.tfrecord")
            with tf.io.TFRecordWriter(path) as writer:
                for row in zip(*(cols[n].tolist() for n in names), strict=True):
                    feature = {}
                    for name, value in zip(names, row, strict=True):
                        if isinstance(value, int):
                            feature[name] = tf.train.Feature(
                                int64_list=tf.train.Int64List(value=[value])
                            )
                        else:
                            feature[name] = tf.train.Feature(
                                float_list=tf.train.FloatList(value=[value])
                            )
                    example = tf.train.Example(features=tf.train.Features(feature=feature))
                    writer.write(example.SerializeToString())
            paths["tfrecord"].append(path)
        if "text" in formats:
            path = os.path.join(folder, f"part-{f}.csv")
            table = np.column_stack([cols[n].astype(np.float64) for n in names])
            fmt = ",".join("%d" if cols[n].dtype == np.int64 else "%.6f" for n in names)
            np.savetxt(path, table, fmt=fmt, delimiter=",")
            paths["text"].append(path)
        if "parquet" in formats:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = os.path.join(folder, f"part-{f}.parquet")
            pq.write_table(pa.table(cols), path, row_group_size=ROWS_PER_GROUP)
            paths["parquet"].append(path)
    return paths


def parse_fns() -> dict:
    """The batched parse of each format, the same on both sides."""
    import tensorflow as tf

    names = list(columns(0, 1))
    spec = {
        n: tf.io.FixedLenFeature([], tf.int64 if n == "id" or n.startswith("c") else tf.float32)
        for n in names
    }
    defaults = [[0] if n == "id" or n.startswith("c") else [0.0] for n in names]

    def tfrecord(records):
        features = tf.io.parse_example(records, spec)
        return features, features.pop("label")

    def text(lines):
        values = tf.io.decode_csv(lines, defaults)
        features = dict(zip(names, values, strict=True))
        return features, features.pop("label")

    def parquet(batch):
        features = dict(batch)
        return features, features.pop("label")

    return {"tfrecord": tfrecord, "text": text, "parquet": parquet}


def _options(ds):
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    options.deterministic = True
    return ds.with_options(options)


def plain_dataset(fmt: str, paths: list[str], batch: int, parse):
    """The plain tf.data reader of the files, batched and parsed."""
    import tensorflow as tf

    if fmt == "tfrecord":
        ds = tf.data.TFRecordDataset(paths).batch(batch)
    elif fmt == "text":
        ds = tf.data.TextLineDataset(paths).batch(batch)
    else:
        import pyarrow.parquet as pq

        names = list(columns(0, 1))

        def batches():
            for path in paths:
                for b in pq.ParquetFile(path).iter_batches(batch_size=batch):
                    yield {n: b.column(n).to_numpy() for n in names}

        signature = {
            n: tf.TensorSpec([None], tf.int64 if n == "id" or n.startswith("c") else tf.float32)
            for n in names
        }
        ds = tf.data.Dataset.from_generator(batches, output_signature=signature)
    ds = ds.map(parse, num_parallel_calls=2, deterministic=True)
    return _options(ds.prefetch(2))


def count(data, expected: int, ds=None, master_pid: int = 0) -> tuple[int, float, float]:
    """(records, seconds and CPU seconds until the batch with the `expected`th record) of one
    pass over `data`, reporting each batch to `ds` if given. The CPU is this process's (all
    its threads) and the master's."""
    records = 0
    seconds = cpu = 0.0

    def used() -> float:
        return time.process_time() + (cpu_seconds(master_pid) if master_pid else 0.0)

    started, cpu_started = time.perf_counter(), used()
    for step, (_, labels) in enumerate(data, 1):
        records += int(labels.shape[0])
        if records == expected:
            seconds, cpu = time.perf_counter() - started, used() - cpu_started
        if ds is not None:
            ds.step_done(step)
    if ds is not None:
        ds.flush()
    return records, seconds, cpu


def index_rates(paths: dict[str, list[str]], cache_dir: str) -> dict:
    """Index build time of each format with no cache (next-to-data indexes removed first)."""
    from master.client.files import cache
    from master.client.files.fileset import index_files

    out = {}
    for fmt, files in paths.items():
        for path in files:
            for where in cache.candidates(path, fmt, [cache_dir]):
                if os.path.exists(where):
                    os.unlink(where)
        started = time.perf_counter()
        index_files(files, fmt, [cache_dir])
        seconds = time.perf_counter() - started
        mb = sum(os.path.getsize(p) for p in files) / 1e6
        out[fmt] = {"seconds": seconds, "mb": mb, "mb_per_s": mb / seconds}
        log.info("index %-8s %7.1f MB in %.2f s: %.0f MB/s", fmt, mb, seconds, mb / seconds)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=400_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--data-dir", help="keep the data files here (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("master").setLevel(logging.WARNING)
    logging.getLogger("dlrover_tf").setLevel(logging.WARNING)
    import tensorflow as tf  # noqa: F401 (imported before the master child starts)

    from dlrover_tf.dataset import ShardedDataset
    from master.client import MasterClient, NodeIdentity

    tmp = tempfile.mkdtemp(prefix="bench-files-")
    # Reports coalesced through a node-local position file, as the local platform runs nodes.
    os.environ["DLROVER_POSITION_FILE"] = os.path.join(tmp, "positions")
    data_dir = args.data_dir or os.path.join(tmp, "data")
    os.makedirs(data_dir, exist_ok=True)
    master = Child(multiprocessing.get_context("spawn"), "master", master_main, tmp)
    try:
        started = time.perf_counter()
        paths = write_data(data_dir, args.records, formats)
        log.info(
            "wrote %d records x %s in %.0f s", args.records, formats, time.perf_counter() - started
        )
        indexes = index_rates(paths, os.path.join(tmp, "index-cache"))
        _, port, token, node_id = master.recv(MASTER_START_TIMEOUT_S, "starting")
        client = MasterClient(f"127.0.0.1:{port}", token, NodeIdentity("worker", 0, node_id))
        parse = parse_fns()
        runs: dict[str, list[dict]] = {}
        variants = [(f, False) for f in formats]
        if "tfrecord" in formats:
            variants.append(("tfrecord", True))
        for r in range(args.rounds):
            for fmt, shuffle in variants:
                key = f"{fmt}_shuffled" if shuffle else fmt
                # Alternate which side goes first, so a drift in the machine's load cancels.
                sides = ("plain", "ours") if r % 2 == 0 else ("ours", "plain")
                got = {}
                for side in sides:
                    if side == "plain":
                        plain = plain_dataset(fmt, paths[fmt], args.batch, parse[fmt])
                        got[side] = count(plain, args.records)
                        continue
                    ds = ShardedDataset.from_files(
                        f"{key}-{r}",
                        paths[fmt],
                        fmt,
                        args.batch,
                        shuffle=shuffle,
                        seed=r,
                        cache_dirs=[os.path.join(tmp, "index-cache")],
                        client=client,
                    )
                    data = ds.to_tf_dataset(parse[fmt])
                    got[side] = count(data, args.records, ds, master.proc.pid)
                    ds.close()
                if (got["ours"][0], got["plain"][0]) != (args.records, args.records):
                    raise RuntimeError(f"{key}: read {got} of {args.records} records")
                run = {side: n / seconds for side, (n, seconds, _) in got.items()}
                run["ratio"] = run["ours"] / run["plain"]
                # Records per CPU second, ours (with the master's) over plain's.
                run["cpu_ratio"] = got["plain"][2] / got["ours"][2]
                runs.setdefault(key, []).append(run)
                log.info(
                    "round %d %-17s ours %8.0f rec/s  plain %8.0f rec/s  ratio %.3f  "
                    "cpu ratio %.3f",
                    r,
                    key,
                    run["ours"],
                    run["plain"],
                    run["ratio"],
                    run["cpu_ratio"],
                )
        client.close()
    finally:
        master.stop()
        if not args.data_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    result: dict = {"records": args.records, "batch": args.batch, "rounds": args.rounds}
    for key, rs in runs.items():
        result[f"{key}_ratio"] = round(statistics.median(r["ratio"] for r in rs), 3)
        result[f"{key}_cpu_ratio"] = round(statistics.median(r["cpu_ratio"] for r in rs), 3)
        result[f"{key}_ours_per_s"] = round(statistics.median(r["ours"] for r in rs))
        result[f"{key}_plain_per_s"] = round(statistics.median(r["plain"] for r in rs))
    if "tfrecord" in indexes:
        result["index_mb_per_s"] = round(indexes["tfrecord"]["mb_per_s"], 1)
    for fmt, figures in indexes.items():
        result[f"index_{fmt}_seconds"] = round(figures["seconds"], 3)
        result[f"index_{fmt}_mb"] = round(figures["mb"], 1)
    result["root"] = ROOT
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
