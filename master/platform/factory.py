"""Build the platform a job runs on from its name: local (default), ray or k8s."""

from __future__ import annotations

from collections.abc import Mapping

from master.platform.api import Platform, PlatformError

PLATFORMS = ("local", "ray", "k8s")


def create_platform(kind: str, host: str, options: Mapping[str, str] | None = None) -> Platform:
    """The platform named `kind`; SDK-backed ones are imported only when asked for."""
    options = dict(options or {})
    try:
        return _create(kind, host, options)
    except (ValueError, ImportError) as e:
        raise PlatformError(f"--platform {kind}: {e}") from e


def _create(kind: str, host: str, options: dict[str, str]) -> Platform:
    if kind == "local":
        from master.platform.local import LocalPlatform

        lifeline = options.get("lifeline_fd")
        return LocalPlatform(host=host, lifeline_fd=int(lifeline) if lifeline else None)
    if kind == "ray":
        from master.platform.ray.platform import RayPlatform

        return RayPlatform(host=host, **options)
    if kind == "k8s":
        from master.platform.kubernetes import KubernetesPlatform

        return KubernetesPlatform(host=host, **options)
    raise ValueError(f"unknown platform {kind!r}; use one of {', '.join(PLATFORMS)}")
