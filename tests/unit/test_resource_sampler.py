"""Resource stats sent with heartbeats, and the GPU path guarded where no GPU exists."""

import time

from master.client.resources import ResourceSampler, _gpu_stats


def test_cpu_and_memory_of_a_busy_process_are_measured():
    sampler = ResourceSampler()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    stats = sampler.sample()
    assert stats.cpu_percent > 10.0
    assert stats.memory_rss_bytes > 10 * 2**20


def test_no_nvml_gives_no_gpu_stats():
    assert _gpu_stats(None) == []


class FakeNvml:
    """Speaks the pynvml calls the sampler uses, for one 16 GiB GPU at 73% use."""

    class _Util:
        gpu = 73

    class _Mem:
        used = 5 * 2**30
        total = 16 * 2**30

    def nvmlDeviceGetCount(self):  # noqa: N802 (pynvml names)
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return self._Util()

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return self._Mem()


def test_gpu_stats_from_nvml():
    (gpu,) = _gpu_stats(FakeNvml())
    assert gpu.utilization_percent == 73.0 and gpu.memory_total_bytes == 16 * 2**30
