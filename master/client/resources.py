"""What a node uses: CPU and memory of its processes, the container's memory limit, and GPU
use through NVML where a GPU and the pynvml package exist (no GPU: no GPU stats, no error)."""

from __future__ import annotations

import logging

from master.pb import nodes_pb2

log = logging.getLogger(__name__)


class ResourceSampler:
    """CPU and memory of this process (and its children), and GPUs when NVML is present.

    Keeps its psutil handles between samples: CPU percent is measured since the last sample.
    """

    def __init__(self, include_children: bool = False) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self._children: dict[int, object] = {}
        # Listing children scans all of /proc: only agents that own worker processes ask.
        self._include_children = include_children
        self._proc.cpu_percent(interval=None)
        self._nvml = _load_nvml()

    def sample(self) -> nodes_pb2.ResourceStats:
        procs = [self._proc]
        if self._include_children:
            current = {}
            for child in self._proc.children(recursive=True):
                current[child.pid] = self._children.get(child.pid, child)
            self._children = current
            procs.extend(current.values())
        cpu = 0.0
        rss = 0
        for p in procs:
            try:
                cpu += p.cpu_percent(interval=None)
                rss += p.memory_info().rss
            except self._psutil.Error:
                continue
        stats = nodes_pb2.ResourceStats(
            cpu_percent=cpu, memory_rss_bytes=rss, memory_limit_bytes=cgroup_memory_limit()
        )
        stats.gpus.extend(_gpu_stats(self._nvml))
        return stats


CGROUP_MEMORY_LIMIT_FILES = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
)


def cgroup_memory_limit(files: tuple[str, ...] = CGROUP_MEMORY_LIMIT_FILES) -> int:
    """This container's memory limit in bytes, 0 if none (the master's OOM diagnosis uses it)."""
    import psutil

    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < psutil.virtual_memory().total:
            return int(text)
        return 0  # "max", or a v1 "unlimited" larger than the machine
    return 0


def _load_nvml():
    """The pynvml module, initialised, or None where there is no NVML (no GPU or no package)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError when no driver is present
        return None
    return pynvml


def _gpu_stats(nvml) -> list[nodes_pb2.GpuStats]:
    """Utilisation and memory of every GPU NVML sees."""
    if nvml is None:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                nodes_pb2.GpuStats(
                    index=i,
                    utilization_percent=float(util.gpu),
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                )
            )
    except Exception as e:  # a GPU that fell off the bus must not stop heartbeats
        log.warning("reading GPU stats failed: %s", e)
    return out
