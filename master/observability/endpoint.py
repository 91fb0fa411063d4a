"""One job master's observability, started and stopped together: time series, Prometheus
metrics (with RPC timing for the gRPC server, the garbage collector's pauses) and the HTTP(S)
server of /metrics and the dashboard, which asks for the job's dashboard token
(master.observability.dashboard.auth)."""

from __future__ import annotations

import secrets

import grpc

from master.client.tls import ServerTLS
from master.job.master import JobMaster
from master.observability.dashboard.auth import load_or_create_token, token_path
from master.observability.dashboard.server import ObservabilityServer
from master.observability.gc_pauses import GcPauses
from master.observability.metrics import JobMetrics
from master.observability.telemetry import JobTelemetry


class Observability:
    """Telemetry, metrics and their HTTP endpoint for one JobMaster.

    The dashboard token is RUN_DIR/.dashboard_token (made on first start, kept on restarts); a
    job without a run dir gets a token that only this process knows (`token`). With `tls`, the
    endpoint is HTTPS with the master's certificate."""

    def __init__(self, job: JobMaster, host: str, port: int, tls: ServerTLS | None = None) -> None:
        self.job = job
        self.telemetry = JobTelemetry(job)
        self.metrics = JobMetrics(job, self.telemetry)
        self.gc_pauses = GcPauses()
        self.metrics.registry.register(self.gc_pauses)
        run_dir = job.runtime.run_dir
        self.token = load_or_create_token(run_dir) if run_dir else secrets.token_urlsafe(32)
        self.token_file = token_path(run_dir) if run_dir else ""
        # Binds now, so a taken --metrics-port fails before any node is launched.
        self.server = ObservabilityServer(
            job, self.metrics, self.telemetry, host, port, token=self.token, tls=tls
        )
        self.url = ""

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        """Interceptors the job's gRPC server must install (RPC latency histograms)."""
        return [self.metrics.interceptor()]

    def start(self, advertised_host: str) -> str:
        """Start sampling and serving; returns the dashboard URL (also set on the job's runtime).
        The URL carries no token."""
        port = self.server.start()
        self.telemetry.start()
        self.gc_pauses.start()
        self.url = f"{self.server.scheme}://{advertised_host}:{port}/"
        self.job.runtime.dashboard_url = self.url
        return self.url

    def stop(self) -> None:
        """Take the last sample and stop serving."""
        self.gc_pauses.stop()
        self.telemetry.stop()
        self.server.stop()
