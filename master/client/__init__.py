"""The one client library every node uses to talk to the master.

One module per client: `master` (MasterClient, the channel and call retries), `progress`
(ProgressStream), `heartbeat` (HeartbeatThread), `resources` (ResourceSampler), `rendezvous`
(RendezvousClient), `kv` (KVClient); `env` reads the DLROVER_* environment, `identity` and
`errors` are shared by all, `kv_keys` names the KV keys the master and the TF side share, `tls`
builds channel credentials. The names below are the public API: import them from here. Each
module is imported when one of its names is first used, so a process that needs only a little
(the pod guard) stays small.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AGENT_EVENTS_KEY": "master.client.kv_keys",
    "CGROUP_MEMORY_LIMIT_FILES": "master.client.resources",
    "CHECKPOINT_COST_KEY": "master.client.kv_keys",
    "CHECKPOINT_INTERVAL_KEY": "master.client.kv_keys",
    "CHECKPOINT_REQUESTS_KEY": "master.client.kv_keys",
    "CHIEF_SESSION_KEY": "master.client.kv_keys",
    "COORDINATOR_KEY": "master.client.kv_keys",
    "ClientTLS": "master.client.tls",
    "ENV_JOB_TOKEN": "master.client.env",
    "ENV_JOB_TOKEN_FILE": "master.client.env",
    "ENV_MASTER_ADDR": "master.client.env",
    "ENV_NODE_ID": "master.client.env",
    "ENV_NODE_RANK": "master.client.env",
    "ENV_NODE_TYPE": "master.client.env",
    "HeartbeatThread": "master.client.heartbeat",
    "KVClient": "master.client.kv",
    "MAX_MESSAGE_BYTES": "master.client.master",
    "MAX_WAIT_CHUNK_MS": "master.client.kv",
    "MasterClient": "master.client.master",
    "MasterError": "master.client.errors",
    "NodeIdentity": "master.client.identity",
    "PAUSE_KEY": "master.client.kv_keys",
    "PS_SERVING_KEY": "master.client.kv_keys",
    "PS_STANDBY_KEY": "master.client.kv_keys",
    "ProgressStream": "master.client.progress",
    "REOPEN_DELAY_SECONDS": "master.client.progress",
    "RendezvousClient": "master.client.rendezvous",
    "ResourceSampler": "master.client.resources",
    "StaleNodeError": "master.client.errors",
    "TLSError": "master.client.tls",
    "TOKEN_METADATA_KEY": "master.client.master",
    "cgroup_memory_limit": "master.client.resources",
    "checkpoint_request_key": "master.client.kv_keys",
    "decode_indices": "master.client.master",
    "pause_key": "master.client.kv_keys",
    "process_heartbeat": "master.client.heartbeat",
    "ps_serving_key": "master.client.kv_keys",
    "ps_standby_key": "master.client.kv_keys",
    "read_token": "master.client.env",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CGROUP_MEMORY_LIMIT_FILES",
    "CHECKPOINT_COST_KEY",
    "CHECKPOINT_INTERVAL_KEY",
    "CHECKPOINT_REQUESTS_KEY",
    "CHIEF_SESSION_KEY",
    "COORDINATOR_KEY",
    "ENV_JOB_TOKEN",
    "ENV_JOB_TOKEN_FILE",
    "ENV_MASTER_ADDR",
    "ENV_NODE_ID",
    "ENV_NODE_RANK",
    "ENV_NODE_TYPE",
    "MAX_MESSAGE_BYTES",
    "MAX_WAIT_CHUNK_MS",
    "PAUSE_KEY",
    "PS_SERVING_KEY",
    "PS_STANDBY_KEY",
    "REOPEN_DELAY_SECONDS",
    "TOKEN_METADATA_KEY",
    "ClientTLS",
    "HeartbeatThread",
    "KVClient",
    "MasterClient",
    "MasterError",
    "NodeIdentity",
    "ProgressStream",
    "RendezvousClient",
    "ResourceSampler",
    "StaleNodeError",
    "TLSError",
    "checkpoint_request_key",
    "cgroup_memory_limit",
    "decode_indices",
    "pause_key",
    "process_heartbeat",
    "ps_serving_key",
    "ps_standby_key",
    "read_token",
]
