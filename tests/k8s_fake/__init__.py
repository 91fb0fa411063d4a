"""A fake Kubernetes API server for tests: REST + watch for the real `kubernetes` client.

`FakeKubeApiServer` serves on loopback; `.kubelet` lets a test play the kubelet (run, exit,
OOM-kill, evict, lose the node), `.jobs` the Job controller (start a Job's pod); `.store`
exposes compaction (410 Gone), dropped watches and the request log.
"""

from tests.k8s_fake.kubelet import FakeJobController, FakeKubelet
from tests.k8s_fake.server import FakeKubeApiServer
from tests.k8s_fake.store import ApiError, ObjectStore

__all__ = ["ApiError", "FakeJobController", "FakeKubeApiServer", "FakeKubelet", "ObjectStore"]
