"""The `dlrover` command: one module per subcommand, and the submission paths (the local
supervisor, Kubernetes)."""
