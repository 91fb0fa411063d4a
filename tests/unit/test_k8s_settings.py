"""The Kubernetes platform's cluster-behaviour settings: read from the master pod's env, checked,
and written back into the master pod only where they differ from the defaults."""

from __future__ import annotations

import pytest

from master.platform.k8s_settings import (
    DEFAULT_API_RETRY_BUDGET_SECONDS,
    ENV_API_RETRY_BUDGET_SECONDS,
    ENV_IMAGE_PULL_TIMEOUT_SECONDS,
    ENV_JOB_NAME,
    ENV_NODE_LOST_GRACE_SECONDS,
    K8sConfigError,
    K8sSettings,
)


def test_settings_come_from_the_env_and_options_win():
    env = {
        ENV_JOB_NAME: "j",
        ENV_API_RETRY_BUDGET_SECONDS: "30",
        ENV_NODE_LOST_GRACE_SECONDS: "2.5",
    }
    s = K8sSettings.from_env(env, image_pull_timeout_seconds="90")
    assert s.api_retry_budget_seconds == 30.0
    assert s.node_lost_grace_seconds == 2.5
    assert s.image_pull_timeout_seconds == 90.0
    assert K8sSettings.from_env({ENV_JOB_NAME: "j"}).api_retry_budget_seconds == (
        DEFAULT_API_RETRY_BUDGET_SECONDS
    )
    written = {e["name"]: e["value"] for e in s.static_env()}
    assert written[ENV_NODE_LOST_GRACE_SECONDS] == "2.5"
    assert written[ENV_IMAGE_PULL_TIMEOUT_SECONDS] == "90"
    assert "DLROVER_K8S_API_TIMEOUT_SECONDS" not in written  # the default is not written


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_a_bad_value_names_its_variable(value):
    with pytest.raises(K8sConfigError, match=ENV_NODE_LOST_GRACE_SECONDS):
        K8sSettings.from_env({ENV_JOB_NAME: "j", ENV_NODE_LOST_GRACE_SECONDS: value})
