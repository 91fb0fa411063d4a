"""A live master on loopback whose nodes are registered by hand (no processes launched)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from master.client import MasterClient, NodeIdentity
from master.config import parse_job_spec
from master.job.master import JobMaster, JobRuntime
from master.platform.local import LocalPlatform
from master.rpc.aio_server import start_aio_server
from master.rpc.server import start_server
from master.state.sqlite import SQLiteStateStore

TOKEN = "test-token-0123456789"


@dataclass
class Harness:
    job: JobMaster
    addr: str
    nodes: list[NodeIdentity]

    def client(self, i: int = 0, token: str = TOKEN, **kw) -> MasterClient:
        return MasterClient(self.addr, token, self.nodes[i], **kw)


@pytest.fixture(params=["sync", "aio"])
def harness(tmp_path, request):
    """Both servers (`rpc_server`) serve the same calls with the same answers."""
    spec = parse_job_spec(
        {"name": "harness", "command": ["true"], "worker": {"replicas": 4}},
        source="test",
        base_dir=str(tmp_path),
    )
    store = SQLiteStateStore(str(tmp_path / "state.sqlite"))
    platform = LocalPlatform()
    job = JobMaster(spec, platform, store, JobRuntime(str(tmp_path), "", ""))
    nodes = []
    for rank in range(4):
        node = job.nodes.new_incarnation("worker", rank, 0, 0)
        job.nodes.mark_running(node.id, platform.address_for("worker", rank), "")
        nodes.append(NodeIdentity("worker", rank, node.id))
    start = start_aio_server if request.param == "aio" else start_server
    server, port = start(job, "127.0.0.1", 0, TOKEN, 32, 1000)
    yield Harness(job, f"127.0.0.1:{port}", nodes)
    server.stop(grace=0).wait()
    job.sharding.close()
    platform.shutdown(1)
    store.close()
