"""The `kubernetes` client, imported lazily: an API client for this process and clear errors.

The master runs without the client elsewhere: only the Kubernetes platform and
`dlrover submit --platform k8s` ask for it, through `import_client`.
"""

from __future__ import annotations

import os
from typing import Any

from master.platform.k8s_errors import api_error_message  # noqa: F401 (the name callers know)
from master.platform.k8s_settings import K8sConfigError


def import_client() -> tuple[Any, Any]:
    """The `kubernetes.client` and `kubernetes.config` modules; K8sConfigError without them."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise K8sConfigError(
            "the Kubernetes platform needs the `kubernetes` client: "
            "pip install 'dlrover-elastic[k8s]' (the image installs it by default)"
        ) from None
    return client, config


def default_api_client() -> Any:
    """An ApiClient from the pod's service account, or from the kubeconfig outside a cluster."""
    client, config = import_client()

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            # KUBECONFIG is read now, not when the client was imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (config.ConfigException, OSError) as e:
            raise K8sConfigError(
                "no Kubernetes credentials: not running in a pod with a service account, and "
                f"no usable kubeconfig ({e}). Run the master in the cluster "
                "(`dlrover submit --platform k8s`) or set KUBECONFIG"
            ) from None
    return client.ApiClient()
