"""Prometheus metrics of one job master, in a registry of its own (never the global one).

Job state (steps, records, nodes, shard queues, node resources) is read at scrape time by a
custom collector; RPC latencies are timed by a gRPC server interceptor; relaunches, events and
checkpoints are counted as they happen.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from master.config import NODE_TYPES
from master.job.events import JobEvent
from master.nodes.model import NodeState
from master.rpc.rewrap import RewrappingInterceptor, async_gen_only, by_kind, rewrap

if TYPE_CHECKING:
    from master.job.master import JobMaster
    from master.observability.telemetry import JobTelemetry

# Unary RPCs range from ~0.1 ms (a heartbeat) to the 60 s a blocking GetShard may wait.
RPC_BUCKETS_SECONDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
CHECKPOINT_BUCKETS_SECONDS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class JobMetrics:
    """The metrics of one JobMaster; `render()` is the text a Prometheus scrape receives."""

    def __init__(self, job: JobMaster, telemetry: JobTelemetry | None = None) -> None:
        self.job = job
        self.telemetry = telemetry
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "dlrover_rpc_duration_seconds",
            "Time the master took to answer a unary RPC (blocking calls include their wait)",
            ["method", "code"],
            buckets=RPC_BUCKETS_SECONDS,
            registry=self.registry,
        )
        self.stream_messages = Counter(
            "dlrover_rpc_stream_messages",
            "Messages received on client-streaming RPCs (per-step progress reports)",
            ["method"],
            registry=self.registry,
        )
        self.events = Counter(
            "dlrover_events", "Job events by kind", ["kind"], registry=self.registry
        )
        self.relaunches = Counter(
            "dlrover_relaunches",
            "Node relaunches by node type and the classified reason of the failure",
            ["type", "reason"],
            registry=self.registry,
        )
        self.node_failures = Counter(
            "dlrover_node_failures",
            "Node failures by node type and classified reason",
            ["type", "reason"],
            registry=self.registry,
        )
        self.checkpoints = Counter(
            "dlrover_checkpoints", "Model checkpoints completed", registry=self.registry
        )
        self.checkpoint_interval = Histogram(
            "dlrover_checkpoint_interval_seconds",
            "Time between consecutive completed checkpoints",
            buckets=CHECKPOINT_BUCKETS_SECONDS,
            registry=self.registry,
        )
        self.last_checkpoint_step = Gauge(
            "dlrover_last_checkpoint_step",
            "Global step of the latest completed checkpoint",
            registry=self.registry,
        )
        self.registry.register(_JobCollector(self))
        job.event_log.add_listener(self._on_event)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this job."""
        return generate_latest(self.registry)

    def interceptor(self) -> grpc.ServerInterceptor:
        """A gRPC server interceptor that times every call into `rpc_seconds`."""
        return RpcTimingInterceptor(self.rpc_seconds, self.stream_messages)

    def _on_event(self, event: JobEvent) -> None:
        self.events.labels(event.kind).inc()
        if event.kind == "relaunch":
            self.relaunches.labels(event.node_type, event.reason or "unknown").inc()
        elif event.kind == "node_failed":
            self.node_failures.labels(event.node_type, event.reason or "unknown").inc()
        elif event.kind == "checkpoint":
            self.checkpoints.inc()
            self.last_checkpoint_step.set(event.details.get("global_step", 0))
            interval = event.details.get("seconds_since_previous")
            if interval is not None:
                self.checkpoint_interval.observe(interval)


class _JobCollector(Collector):
    """Reads the job's live state at scrape time."""

    def __init__(self, metrics: JobMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        job = self._m.job
        info = GaugeMetricFamily(
            "dlrover_job_state", "1 for the job's current state", labels=["job", "state"]
        )
        info.add_metric([job.spec.name, job.state.value], 1)
        yield info
        yield _gauge("dlrover_global_step", "The job's global training step", job.global_step)
        yield _gauge("dlrover_job_elapsed_seconds", "Time since the job started", job.elapsed())
        latest = self._m.telemetry.latest() if self._m.telemetry else None
        yield _gauge(
            "dlrover_steps_per_second",
            "Global steps per second over the last few seconds",
            latest.steps_per_second if latest else 0.0,
        )
        yield _gauge(
            "dlrover_records_per_second",
            "Records trained per second over the last few seconds",
            latest.records_per_second if latest else 0.0,
        )
        yield from self._datasets()
        yield from self._nodes()

    def _datasets(self) -> Iterator[Metric]:
        records = GaugeMetricFamily(
            "dlrover_dataset_records",
            "Records of a dataset (all epochs) by shard queue: todo, doing, done, redone",
            labels=["dataset", "queue"],
        )
        epoch = GaugeMetricFamily(
            "dlrover_dataset_epoch", "Current epoch of a dataset (0-based)", labels=["dataset"]
        )
        for s in self._m.job.sharding.stats():
            for queue, value in (
                ("todo", s.records_todo),
                ("doing", s.records_doing),
                ("done", s.records_done),
                ("redone", s.records_redone),
            ):
                records.add_metric([s.name, queue], value)
            epoch.add_metric([s.name], s.current_epoch)
        yield records
        yield epoch

    def _nodes(self) -> Iterator[Metric]:
        current = self._m.job.nodes.all_current()
        by_state = GaugeMetricFamily(
            "dlrover_nodes", "Current node incarnations by type and state", labels=["type", "state"]
        )
        for node_type in NODE_TYPES:
            for state in NodeState:
                n = sum(1 for x in current if x.type == node_type and x.state == state)
                by_state.add_metric([node_type, state.value], n)
        yield by_state
        labels = ["type", "rank"]
        cpu = GaugeMetricFamily(
            "dlrover_node_cpu_percent", "Node CPU use (100 = one core busy)", labels=labels
        )
        rss = GaugeMetricFamily(
            "dlrover_node_memory_rss_bytes", "Node resident memory", labels=labels
        )
        step = GaugeMetricFamily(
            "dlrover_node_step_seconds", "Node's median time per step (recent steps)", labels=labels
        )
        gpu_util = GaugeMetricFamily(
            "dlrover_node_gpu_utilization_percent", "GPU utilization", labels=[*labels, "gpu"]
        )
        gpu_mem = GaugeMetricFamily(
            "dlrover_node_gpu_memory_used_bytes", "GPU memory in use", labels=[*labels, "gpu"]
        )
        for node in current:
            if node.state != NodeState.RUNNING:
                continue
            key = [node.type, str(node.rank)]
            cpu.add_metric(key, node.cpu_percent)
            rss.add_metric(key, node.memory_rss_bytes)
            if node.steps > 1:
                step.add_metric(key, node.step_seconds)
            for gpu in node.gpus:
                gpu_util.add_metric([*key, str(gpu.index)], gpu.utilization_percent)
                gpu_mem.add_metric([*key, str(gpu.index)], gpu.memory_used_bytes)
        yield from (cpu, rss, step, gpu_util, gpu_mem)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class RpcTimingInterceptor(RewrappingInterceptor):
    """Wraps each RPC handler so unary calls are timed and stream messages counted."""

    def __init__(self, histogram: Histogram, stream_messages: Counter) -> None:
        super().__init__()
        self._histogram = histogram
        self._stream_messages = stream_messages

    def rewrap_handler(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        name = method.rsplit("/", 1)[-1]
        return rewrap(
            handler,
            unary=by_kind(lambda b: self._timed(b, name), lambda b: self._timed_async(b, name)),
            stream_in=by_kind(
                lambda b: self._counted(b, name), lambda b: self._counted_async(b, name)
            ),
            bidi=async_gen_only(lambda b: self._timed_each_async(b, name)),
        )

    def _timed_each_async(self, behavior: Callable, method: str) -> Callable:
        """Each ask on a bidirectional stream (answered in order) is counted as a message and
        timed from its arrival to its answer, as a unary call would be."""
        counter = self._stream_messages.labels(method)
        ok = self._histogram.labels(method, "OK")

        async def timed(requests: AsyncIterator, context: grpc.aio.ServicerContext):
            # The handler takes the next ask only once it answered this one: one in flight.
            arrived = [0.0]  # when the ask in flight was taken; 0.0 when none is

            async def each() -> AsyncIterator:
                async for request in requests:
                    counter.inc()
                    arrived[0] = time.perf_counter()
                    yield request

            try:
                async for reply in behavior(each(), context):
                    ok.observe(time.perf_counter() - arrived[0])
                    arrived[0] = 0.0
                    yield reply
            except BaseException:  # the ask in flight failed (an abort ends the stream)
                if arrived[0]:
                    code = _code_name(context, "UNKNOWN")
                    code = "UNKNOWN" if code == "OK" else code
                    self._histogram.labels(method, code).observe(time.perf_counter() - arrived[0])
                raise

        return timed

    def _timed(self, behavior: Callable, method: str) -> Callable:
        histogram = self._histogram
        ok = histogram.labels(method, "OK")  # the common case, looked up once

        def timed(request: object, context: grpc.ServicerContext) -> object:
            start = time.perf_counter()
            code = "OK"
            try:
                return behavior(request, context)
            except Exception:
                code = _code_name(context, "UNKNOWN")
                raise
            finally:
                if code == "OK":
                    code = _code_name(context, "OK")
                child = ok if code == "OK" else histogram.labels(method, code)
                child.observe(time.perf_counter() - start)

        return timed

    def _timed_async(self, behavior: Callable, method: str) -> Callable:
        histogram = self._histogram
        ok = histogram.labels(method, "OK")

        async def timed(request: object, context: grpc.aio.ServicerContext) -> object:
            start = time.perf_counter()
            code = "OK"
            try:
                return await behavior(request, context)
            except BaseException:  # an abort raises asyncio's AbortError, a BaseException
                code = _code_name(context, "UNKNOWN")
                raise
            finally:
                if code == "OK":
                    code = _code_name(context, "OK")
                child = ok if code == "OK" else histogram.labels(method, code)
                child.observe(time.perf_counter() - start)

        return timed

    def _counted_async(self, behavior: Callable, method: str) -> Callable:
        counter = self._stream_messages.labels(method)

        async def counting(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> object:
            async def each() -> AsyncIterator:
                async for request in requests:
                    counter.inc()
                    yield request

            return await behavior(each(), context)

        return counting

    def _counted(self, behavior: Callable, method: str) -> Callable:
        counter = self._stream_messages.labels(method)

        def counting(requests: Iterator, context: grpc.ServicerContext) -> object:
            def each() -> Iterator:
                for request in requests:
                    counter.inc()
                    yield request

            return behavior(each(), context)

        return counting


def _code_name(context: grpc.ServicerContext, default: str) -> str:
    """The status code the handler set (abort or set_code), else `default`."""
    code = context.code() if hasattr(context, "code") else None
    return code.name if isinstance(code, grpc.StatusCode) else default
