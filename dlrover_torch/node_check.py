"""Node check: a CPU compute and all-reduce timing round that finds faulty and straggling nodes.

Before training (``dlrover-run --network-check``) every agent joins a check round of its own
rendezvous, runs one probe process (a spare with torch imported) that times a matmul loop and a
gloo all-reduce with the other nodes, publishes its timings in the round's store and reads
everyone else's. A node whose probe fails or never reports is faulty; a node whose compute time
is more than ``straggler_ratio`` times the median is a straggler. Faulty nodes leave the job,
stragglers leave too with ``--exclude-straggler``. Every node reports what it saw to the master.

On demand, the probe also runs as a training script under any launcher and prints its timings:
``dlrover-run --nnodes 2 ... -m dlrover_torch.node_check``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    from dlrover_torch.agent import DLRoverElasticAgent

log = logging.getLogger(__name__)

RESULT_KEY = "dlrover/node_check/result/"
ENV_INJECT_DELAY = "DLROVER_NODE_CHECK_DELAY"  # rehearsal: seconds a probe sleeps in compute
ENV_INJECT_FAIL = "DLROVER_NODE_CHECK_FAIL"  # rehearsal: a probe that fails


@dataclass(frozen=True)
class ProbeResult:
    """One node's timings (node_rank: the agent's node rank); ok=False when its probe failed."""

    node_rank: int
    ok: bool
    compute_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Verdict:
    """What a check round found: faulty and straggling node ranks, and every timing."""

    faulty: list[int]
    stragglers: list[int]
    results: dict[int, ProbeResult] = field(default_factory=dict)
    median_compute_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "faulty": self.faulty,
            "stragglers": self.stragglers,
            "median_compute_seconds": self.median_compute_seconds,
            "results": {str(k): asdict(v) for k, v in sorted(self.results.items())},
        }


def classify(
    results: Mapping[int, ProbeResult | None], world_size: int, straggler_ratio: float
) -> Verdict:
    """Faulty: no result or a failed probe. Straggler: compute time above ratio x median.

    ``results`` and the returned rank lists use the check round's ranks."""
    faulty = sorted(r for r in range(world_size) if results.get(r) is None or not results[r].ok)
    good = {r: res for r, res in results.items() if res is not None and res.ok}
    # The lower median: with two nodes the faster one is the reference, not their mean.
    median = statistics.median_low(res.compute_seconds for res in good.values()) if good else 0.0
    stragglers = sorted(
        r
        for r, res in good.items()
        if median > 0 and res.compute_seconds > straggler_ratio * median
    )
    known = {r: res for r, res in results.items() if res is not None}
    return Verdict(faulty, stragglers, known, median)


# -- the probe (runs in its own process) ------------------------------------------------------


def probe(
    rank: int,
    world_size: int,
    timeout_seconds: float,
    matmul_size: int = 256,
    matmul_iters: int = 100,
    allreduce_elems: int = 1 << 18,
    allreduce_iters: int = 5,
    inject_delay: float = 0.0,
) -> ProbeResult:
    """Time a matmul loop, then (with peers) a gloo all-reduce; env:// gives the peers."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)
    a = torch.randn(matmul_size, matmul_size)
    t0 = time.perf_counter()
    for _ in range(matmul_iters):
        a = torch.tanh(a @ a)
    if inject_delay > 0:
        time.sleep(inject_delay)
    compute = time.perf_counter() - t0
    allreduce = 0.0
    if world_size > 1:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_seconds)
        )
        try:
            buf = torch.ones(allreduce_elems)
            dist.all_reduce(buf)  # warm-up: connections
            t1 = time.perf_counter()
            for _ in range(allreduce_iters):
                dist.all_reduce(buf)
            allreduce = (time.perf_counter() - t1) / allreduce_iters
        finally:
            dist.destroy_process_group()
    return ProbeResult(rank, True, compute, allreduce)


def main(argv: list[str] | None = None) -> int:
    """Probe entry point: under a launcher (RANK, WORLD_SIZE, MASTER_*) or from the agent."""
    p = argparse.ArgumentParser(description="dlrover node check probe")
    p.add_argument("--out", default="", help="write the result JSON here (else print it)")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    env = os.environ
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    try:
        if env.get(ENV_INJECT_FAIL):
            raise RuntimeError(f"{ENV_INJECT_FAIL} is set: failing on purpose")
        result = probe(rank, world, args.timeout, inject_delay=float(env.get(ENV_INJECT_DELAY, 0)))
    except Exception as e:
        result = ProbeResult(rank, False, error=f"{type(e).__name__}: {e}")
    text = json.dumps(asdict(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text, flush=True)
    return 0 if result.ok else 1


# -- the agent side ---------------------------------------------------------------------------


class NodeCheckRound:
    """Runs one check round for an agent; ``run`` returns False when this node must leave."""

    def __init__(
        self,
        handler_factory: Callable[[], RendezvousHandler],
        timeout_seconds: float = 60.0,
        straggler_ratio: float = 2.0,
        exclude_straggler: bool = False,
    ) -> None:
        self._factory = handler_factory
        self.timeout_seconds = timeout_seconds
        self.straggler_ratio = straggler_ratio
        self.exclude_straggler = exclude_straggler
        self.verdict: Verdict | None = None

    def _run_probe(
        self, agent: DLRoverElasticAgent, rank: int, world: int, addr: str, port: int
    ) -> ProbeResult:
        fd, out_path = tempfile.mkstemp(prefix="dlrover_node_check_", suffix=".json")
        os.close(fd)
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
        )
        argv = ["--out", out_path, "--timeout", str(self.timeout_seconds)]
        pool = agent.spare_pool
        try:
            if pool is not None:
                proc = pool.run_job("dlrover_torch.node_check", argv, env, module=True)
            else:
                cmd = [agent.config.python, "-m", "dlrover_torch.node_check", *argv]
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            try:
                code = proc.wait(self.timeout_seconds + 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return ProbeResult(rank, False, error=f"timed out after {self.timeout_seconds}s")
            try:
                with open(out_path, encoding="utf-8") as f:
                    return ProbeResult(**json.load(f))
            except (OSError, ValueError, TypeError):
                return ProbeResult(rank, False, error=f"the probe exited with code {code}")
        finally:
            os.unlink(out_path)

    def run(self, agent: DLRoverElasticAgent) -> bool:
        handler = self._factory()
        try:
            info = handler.next_rendezvous()
            rank, world, store = info.rank, info.world_size, info.store
            boot = info.bootstrap_store_info
            if boot is None:
                raise RuntimeError("the check rendezvous gave no MASTER_ADDR/PORT for the probe")
            log.info("node check: node %d of %d", rank, world)
            mine = self._run_probe(agent, rank, world, boot.master_addr, boot.master_port)
            # Results are indexed by the check round's rank; each carries its node's own rank.
            mine = replace(mine, node_rank=agent.reporter.node_rank)
            store.set(f"{RESULT_KEY}{rank}", json.dumps(asdict(mine)))
            results: dict[int, ProbeResult | None] = {}
            deadline = time.monotonic() + self.timeout_seconds
            for r in range(world):
                key = f"{RESULT_KEY}{r}"
                left = max(0.0, deadline - time.monotonic())
                try:
                    store.wait([key], timedelta(seconds=left))
                    results[r] = ProbeResult(**json.loads(store.get(key)))
                except Exception as e:  # a node that never reports is faulty
                    log.warning("node check: no result from node %d: %s", r, e)
                    results[r] = None
        finally:
            handler.shutdown()
        verdict = classify(results, world, self.straggler_ratio)
        self.verdict = verdict
        excluded = rank in verdict.faulty or (self.exclude_straggler and rank in verdict.stragglers)
        payload = verdict.to_dict()
        payload.update(node_rank=rank, excluded=excluded, exclude_straggler=self.exclude_straggler)
        agent.reporter.node_check(0, payload)
        if verdict.faulty or verdict.stragglers:
            agent.reporter.event(
                "node_check",
                f"faulty nodes {verdict.faulty}, stragglers {verdict.stragglers} "
                f"(median compute {verdict.median_compute_seconds:.3f}s)",
                excluded=excluded,
            )
        return not excluded


if __name__ == "__main__":
    sys.exit(main())
