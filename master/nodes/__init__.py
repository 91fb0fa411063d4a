"""Nodes of a job: their records, the registry of incarnations and heartbeats, and exit policies."""
