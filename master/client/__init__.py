"""The one client library every node uses to talk to the master.

One module per client: `master` (MasterClient, the channel and call retries), `progress`
(ProgressStream), `heartbeat` (HeartbeatThread), `resources` (ResourceSampler), `rendezvous`
(RendezvousClient), `kv` (KVClient); `env` reads the DLROVER_* environment, `identity` and
`errors` are shared by all, `kv_keys` names the KV keys the master and the TF side share, `tls`
builds channel credentials. The names below are the public API: import them from here.
"""

from master.client.env import (
    ENV_JOB_TOKEN,
    ENV_JOB_TOKEN_FILE,
    ENV_MASTER_ADDR,
    ENV_NODE_ID,
    ENV_NODE_RANK,
    ENV_NODE_TYPE,
    read_token,
)
from master.client.errors import MasterError, StaleNodeError
from master.client.heartbeat import HeartbeatThread
from master.client.identity import NodeIdentity
from master.client.kv import MAX_WAIT_CHUNK_MS, KVClient
from master.client.kv_keys import (
    CHECKPOINT_REQUESTS_KEY,
    COORDINATOR_KEY,
    PAUSE_KEY,
    checkpoint_request_key,
    pause_key,
)
from master.client.master import (
    MAX_MESSAGE_BYTES,
    TOKEN_METADATA_KEY,
    MasterClient,
    decode_indices,
)
from master.client.progress import REOPEN_DELAY_SECONDS, ProgressStream
from master.client.rendezvous import RendezvousClient
from master.client.resources import CGROUP_MEMORY_LIMIT_FILES, ResourceSampler, cgroup_memory_limit
from master.client.tls import ClientTLS, TLSError

__all__ = [
    "CGROUP_MEMORY_LIMIT_FILES",
    "CHECKPOINT_REQUESTS_KEY",
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
    "read_token",
]
