"""Joining a Ray cluster from this process: an existing one by address, or a new local one.

A cluster that only this master uses runs on loopback with authentication off; Ray reads
the loopback switch when `ray` is first imported, so `import_ray` sets it before that.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from typing import Any

from master.platform.api import PlatformError
from master.platform.proc_stats import children_states, stall_pressure

log = logging.getLogger(__name__)

# How long the cluster address may take to accept a TCP connection.
CONNECT_TIMEOUT_SECONDS = 10.0
# A local raylet that never registers (seen once in CI under load) gets a fresh try.
LOCAL_START_ATTEMPTS = 3

# Ray 2.60 turns token authentication on for a cluster ray.init starts; a cluster that only
# this master uses, on loopback, needs none.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# On Linux Ray replaces a loopback node address with the machine's external IP; this switch
# (meant for laptops) makes a local cluster advertise and bind 127.0.0.1 only. Ray reads it
# once, when `ray` is first imported.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reachable(address: str) -> None:
    """Raise OSError when a host:port address accepts no TCP connection."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto" and other forms Ray resolves itself
    with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_SECONDS):
        pass


def import_ray(loopback: bool) -> Any:
    """Import ray, first setting what Ray reads at import time for a loopback cluster."""
    if loopback:
        if "ray" in sys.modules and os.environ.get(LOOPBACK_ENV) != "0":
            log.warning(
                "ray was imported before the Ray platform set %s=0; a local cluster may "
                "advertise the machine's external address instead of loopback",
                LOOPBACK_ENV,
            )
        os.environ[LOOPBACK_ENV] = "0"
    import ray

    return ray


def join_cluster(ray: Any, address: str, namespace: str | None = None) -> None:
    """ray.init on the cluster at `address` (`--ray-address`); PlatformError if it fails."""
    try:
        # ray.init retries an unreachable GCS for minutes; fail fast instead.
        check_reachable(address)
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (OSError, RuntimeError, ValueError) as e:
        raise PlatformError(
            f"cannot connect to the Ray cluster at {address!r} (--ray-address): {e}; "
            "start one with `ray start --head` or leave --ray-address out"
        ) from e


def connect(address: str, namespace: str) -> Any:
    """This process joins the Ray cluster at `address` (`--ray-address`) in `namespace`."""
    ray = import_ray(loopback=is_loopback(address.rsplit(":", 1)[0]))
    join_cluster(ray, address, namespace)
    return ray


def start_local_cluster(num_cpus: int | None = None) -> str:
    """Start a Ray cluster on loopback, auth off, dashboard off, connected to this process.

    Returns its address (for `--ray-address`). The caller ends it with `ray.shutdown()`.
    """
    os.environ.setdefault(AUTH_MODE_ENV, "disabled")
    ray = import_ray(loopback=True)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ctx = ray.init(
                address="local",
                num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            return ctx.address_info["gcs_address"]
        except Exception as e:  # Ray raises a bare Exception when its raylet never comes up
            state = _startup_state()  # before shutdown ends the processes it describes
            ray.shutdown()
            if attempt == LOCAL_START_ATTEMPTS:
                raise PlatformError(
                    f"the local Ray cluster did not start after {attempt} attempts: {e}; "
                    f"see the raylet logs under /tmp/ray/session_latest/logs. {state}"
                ) from e
            log.warning("local Ray cluster failed to start (%s); trying again. %s", e, state)
    raise AssertionError("unreachable")


def _startup_state() -> str:
    """This process's children (name, state, kernel wait channel) and the machine's stall
    pressure: what a start that timed out was waiting on (Linux only; best effort)."""
    children = ", ".join(children_states(os.getpid())) or "none"
    return f"children: {children}; pressure: {'; '.join(stall_pressure()) or 'n/a'}"
