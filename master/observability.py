"""One job master's observability, started and stopped together: time series, Prometheus
metrics (with RPC timing for the gRPC server) and the HTTP server of /metrics and the dashboard."""

from __future__ import annotations

import grpc

from master.dashboard.server import ObservabilityServer
from master.job import JobMaster
from master.metrics import JobMetrics
from master.telemetry import JobTelemetry


class Observability:
    """Telemetry, metrics and their HTTP endpoint for one JobMaster."""

    def __init__(self, job: JobMaster, host: str, port: int) -> None:
        self.job = job
        self.telemetry = JobTelemetry(job)
        self.metrics = JobMetrics(job, self.telemetry)
        # Binds now, so a taken --metrics-port fails before any node is launched.
        self.server = ObservabilityServer(job, self.metrics, self.telemetry, host, port)
        self.url = ""

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        """Interceptors the job's gRPC server must install (RPC latency histograms)."""
        return [self.metrics.interceptor()]

    def start(self, advertised_host: str) -> str:
        """Start sampling and serving; returns the dashboard URL (also set on the job's runtime)."""
        port = self.server.start()
        self.telemetry.start()
        self.url = f"http://{advertised_host}:{port}/"
        self.job.runtime.dashboard_url = self.url
        return self.url

    def stop(self) -> None:
        """Take the last sample and stop serving."""
        self.telemetry.stop()
        self.server.stop()
