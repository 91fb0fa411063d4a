"""What the job shows: Prometheus metrics, time series, the status document and screen, and the
dashboard with its HTTP endpoint."""
