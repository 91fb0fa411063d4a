"""The job's own record in the state store (its runtime and end state), readable without a job."""

from __future__ import annotations

import json
import os

from master.state.factory import open_state_store, parse_state_url

JOB_TABLE = "job"
ENDED_STATES = ("succeeded", "failed", "stopped")


def recorded_job_state(state_path: str, namespace: str) -> str:
    """How the job in the state store stands: "running", its end state, or "" (not started).
    Raises `StateStoreError` when the store cannot be opened."""
    if parse_state_url(state_path).kind == "sqlite" and not os.path.exists(state_path):
        return ""
    store = open_state_store(state_path, job=namespace)
    try:
        started = store.get(JOB_TABLE, "runtime") is not None
        raw = store.get(JOB_TABLE, "status")
    finally:
        store.close()
    state = json.loads(raw)["state"] if raw is not None else ""
    if state in ENDED_STATES:
        return state
    return "running" if started else ""
