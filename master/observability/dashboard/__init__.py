"""The master's HTTP side: Prometheus /metrics, the web dashboard and its JSON API."""
