"""What a node reads from the DLROVER_* variables its master set: how long it waits for the
master, with a clear error on a bad value."""

from __future__ import annotations

import pytest

from master.client import MasterClient
from master.client.env import (
    DEFAULT_MASTER_WAIT_SECONDS,
    ENV_MASTER_WAIT,
    read_master_wait,
)
from master.client.errors import MasterError


def test_a_node_waits_minutes_for_its_master_unless_told_otherwise():
    assert read_master_wait({}) == DEFAULT_MASTER_WAIT_SECONDS >= 120
    assert read_master_wait({ENV_MASTER_WAIT: "15"}) == 15.0
    assert read_master_wait({ENV_MASTER_WAIT: "0"}) == 0.0  # fail at the first refusal


@pytest.mark.parametrize("bad", ["soon", "-1", "nan"])
def test_a_bad_master_wait_names_the_variable_and_what_it_takes(bad):
    with pytest.raises(MasterError, match=f"{ENV_MASTER_WAIT}=.*seconds >= 0"):
        read_master_wait({ENV_MASTER_WAIT: bad})


def test_the_client_built_from_the_environment_uses_it(tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    env = {
        "DLROVER_MASTER_ADDR": "127.0.0.1:1",
        "DLROVER_JOB_TOKEN_FILE": str(token),
        "DLROVER_NODE_TYPE": "worker",
        ENV_MASTER_WAIT: "42",
    }
    client = MasterClient.from_env(env)
    try:
        assert client.retry_seconds == 42.0
    finally:
        client.close()
