"""Typed configuration: the job spec, its YAML reader, and the master's own settings."""

from master.config.errors import SpecError
from master.config.job_yaml import load_job_spec, parse_job_spec
from master.config.master_config import MasterConfig
from master.config.spec import (
    NODE_TYPES,
    STRAGGLER_ACTIONS,
    STUCK_ACTIONS,
    SUCCESS_POLICIES,
    AutoscaleSpec,
    JobSpec,
    NodeGroupSpec,
)

__all__ = [
    "NODE_TYPES",
    "STRAGGLER_ACTIONS",
    "STUCK_ACTIONS",
    "SUCCESS_POLICIES",
    "AutoscaleSpec",
    "JobSpec",
    "MasterConfig",
    "NodeGroupSpec",
    "SpecError",
    "load_job_spec",
    "parse_job_spec",
]
