"""Kubeflow manifests as job specs: a `kubeflow.org/v1` TFJob or PyTorchJob read into a JobSpec.

Each replica type becomes a node group running its container's command (and args, env,
working directory, resources); `runPolicy.backoffLimit` the job's relaunch budget,
`restartPolicy: Never` a group that is never relaunched, `successPolicy` the success policy.
A PyTorchJob's Master and Workers become worker nodes, each running its command under
`dlrover-run` with the `elasticPolicy`. A field we cannot honour is an error naming its path
in the manifest and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from master.config.errors import kind_of, spec_error
from master.config.spec import JobSpec, NodeGroupSpec

API_VERSION = "kubeflow.org/v1"
KINDS = ("TFJob", "PyTorchJob")
# Replica type (lower case) -> our node type.
_TF_REPLICAS = {
    "ps": "ps",
    "chief": "chief",
    "master": "chief",
    "worker": "worker",
    "evaluator": "evaluator",
}
_TORCH_REPLICAS = ("master", "worker")
_SUCCESS_POLICIES = {"": "chief", "AllWorkers": "all_workers"}
_RESTART_POLICIES = ("Always", "OnFailure", "ExitCode", "Never")
_CLEAN_POD_POLICIES = ("Running", "All")
_CONTAINER_FIELDS = {"name", "image", "command", "args", "env", "workingDir", "resources"}
_CONTAINER_FIELDS |= {"imagePullPolicy", "ports"}
_TORCH_LAUNCHERS = (("torchrun",), ("python", "-m", "torch.distributed.run"))
_TORCH_LAUNCHERS += (("python3", "-m", "torch.distributed.run"),)
_DLROVER_RUN = ("python", "-m", "dlrover_torch.run")
# torchrun and dlrover-run flags that take no value.
_FLAGS_WITHOUT_VALUE = ("--standalone", "--no-python", "--run-path", "--no-spare-workers")
_FLAGS_WITHOUT_VALUE += ("--network-check", "--exclude-straggler")
_IGNORED_RDZV = ("rdzvBackend", "rdzvHost", "rdzvPort", "rdzvId", "rdzvConf", "standalone")


def is_kubeflow_manifest(data: object) -> bool:
    """Whether parsed YAML is a Kubeflow training job (by apiVersion and kind)."""
    return (
        isinstance(data, Mapping)
        and str(data.get("apiVersion", "")).startswith("kubeflow.org/")
        and "kind" in data
    )


def manifest_namespace(path: str) -> str:
    """The `metadata.namespace` of a Kubeflow manifest file ("" if none, or not a manifest)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return ""
    if not is_kubeflow_manifest(data) or not isinstance(data.get("metadata"), Mapping):
        return ""
    return str(data["metadata"].get("namespace") or "")


def parse_kubeflow_job(data: Mapping[str, Any], source: str, base_dir: str) -> JobSpec:
    """A TFJob or PyTorchJob manifest as a validated JobSpec (its nodes run in base_dir
    locally; on Kubernetes in the containers' images)."""
    reader = _Reader(source)
    api, kind = data.get("apiVersion"), data.get("kind")
    if api != API_VERSION or kind not in KINDS:
        raise spec_error(
            source,
            "apiVersion, kind",
            f"{api}/{kind} is not a job dlrover reads",
            f"Use apiVersion {API_VERSION} with kind TFJob or PyTorchJob",
        )
    reader.known(data, ("apiVersion", "kind", "metadata", "spec", "status"), "")
    meta = reader.mapping(data.get("metadata"), "metadata")
    name = meta.get("name")
    if not name:
        raise spec_error(source, "metadata.name", "missing", "Add 'metadata: {name: my-job}'")
    spec = reader.mapping(data.get("spec"), "spec")
    groups: dict[str, NodeGroupSpec]
    if kind == "TFJob":
        groups, command, success = _tf_groups(reader, spec)
    else:
        groups, command, success = _torch_groups(reader, spec)
    run_policy = reader.mapping(spec.get("runPolicy") or {}, "spec.runPolicy")
    reader.known(run_policy, ("backoffLimit", "cleanPodPolicy"), "spec.runPolicy")
    for path, clean in (
        ("spec.cleanPodPolicy", spec.get("cleanPodPolicy")),
        ("spec.runPolicy.cleanPodPolicy", run_policy.get("cleanPodPolicy")),
    ):
        if clean is not None and clean not in _CLEAN_POD_POLICIES:
            raise spec_error(
                source,
                path,
                f"{clean!r} is not supported: dlrover stops every pod still running when the "
                "job ends",
                "Use Running or All, or remove it",
            )
    kwargs: dict[str, Any] = {}
    if run_policy.get("backoffLimit") is not None:
        kwargs["max_relaunches"] = run_policy["backoffLimit"]
    return JobSpec(
        name=name,
        command=command,
        workdir=os.path.abspath(base_dir),
        env={},
        ps=groups.get("ps", NodeGroupSpec()),
        chief=groups.get("chief", NodeGroupSpec()),
        worker=groups.get("worker", NodeGroupSpec()),
        evaluator=groups.get("evaluator", NodeGroupSpec()),
        success_policy=success,
        source=source,
        **kwargs,
    )


def _tf_groups(
    reader: _Reader, spec: Mapping[str, Any]
) -> tuple[dict[str, NodeGroupSpec], tuple[str, ...], str]:
    reader.known(
        spec,
        ("tfReplicaSpecs", "runPolicy", "successPolicy", "cleanPodPolicy", "enableDynamicWorker"),
        "spec",
    )
    replicas = reader.mapping(spec.get("tfReplicaSpecs"), "spec.tfReplicaSpecs")
    groups: dict[str, NodeGroupSpec] = {}
    for key, replica in replicas.items():
        path = f"spec.tfReplicaSpecs.{key}"
        node_type = _TF_REPLICAS.get(str(key).lower())
        if node_type is None:
            raise spec_error(
                reader.source,
                path,
                f"unknown replica type {key!r}",
                "Use PS, Chief (or Master), Worker or Evaluator",
            )
        if node_type in groups:
            raise spec_error(
                reader.source, path, "a second chief (Chief and Master)", "Keep one of them"
            )
        group, _ = reader.replica(replica, path)
        if node_type == "worker":
            # TF_CONFIG lists exactly the workers that run, as under the TFJob operator.
            group = _replace(group, max_replicas=group.replicas)
        groups[node_type] = group
    main = groups.get("chief") or groups.get("worker")
    if main is None or not main.command:
        raise spec_error(
            reader.source,
            "spec.tfReplicaSpecs",
            "no Chief, Master or Worker replica, so nothing would train",
            "Add a Worker (or Chief) replica spec with a container command",
        )
    policy = spec.get("successPolicy") or ""
    if policy not in _SUCCESS_POLICIES:
        raise spec_error(
            reader.source,
            "spec.successPolicy",
            f"{policy!r} is not a TFJob success policy",
            "Use AllWorkers, or leave it out (the chief's success ends the job)",
        )
    return groups, main.command, _SUCCESS_POLICIES[policy]


def _torch_groups(
    reader: _Reader, spec: Mapping[str, Any]
) -> tuple[dict[str, NodeGroupSpec], tuple[str, ...], str]:
    reader.known(
        spec, ("pytorchReplicaSpecs", "runPolicy", "elasticPolicy", "nprocPerNode"), "spec"
    )
    replicas = reader.mapping(spec.get("pytorchReplicaSpecs"), "spec.pytorchReplicaSpecs")
    found: dict[str, tuple[NodeGroupSpec, str]] = {}
    for key, replica in replicas.items():
        path = f"spec.pytorchReplicaSpecs.{key}"
        if str(key).lower() not in _TORCH_REPLICAS:
            raise spec_error(
                reader.source, path, f"unknown replica type {key!r}", "Use Master and Worker"
            )
        found[str(key).lower()] = reader.replica(replica, path)
    if not found:
        raise spec_error(
            reader.source,
            "spec.pytorchReplicaSpecs",
            "no replica spec",
            "Add a Worker replica spec with a container command",
        )
    (first, first_path), *others = found.values()
    for group, path in others:
        if group.command != first.command or group.image != first.image:
            raise spec_error(
                reader.source,
                path,
                "Master and Worker run different containers; dlrover runs every torch node "
                "alike (the rank-0 node is the master)",
                "Give them the same image and command",
            )
    nodes = sum(group.replicas for group, _ in found.values())
    flags, high = _elastic_flags(reader, spec, nodes)
    command = _under_dlrover_run(reader, first.command, flags, first_path)
    worker = _replace(first, replicas=nodes, command=command, max_replicas=max(high, nodes))
    return {"worker": worker}, command, "chief"  # the rank-0 node is the PyTorchJob's Master


def _elastic_flags(
    reader: _Reader, spec: Mapping[str, Any], nodes: int
) -> tuple[dict[str, str], int]:
    """`elasticPolicy` (and `nprocPerNode`) as dlrover-run flags, and the most nodes."""
    path = "spec.elasticPolicy"
    elastic = reader.mapping(spec.get("elasticPolicy") or {}, path)
    if "metrics" in elastic:
        raise spec_error(
            reader.source,
            f"{path}.metrics",
            "not supported by dlrover: it does not scale on HPA metrics (the job runs between "
            "minReplicas and maxReplicas, relaunching lost nodes and taking back new ones)",
            "Remove metrics",
        )
    reader.known(
        elastic,
        ("minReplicas", "maxReplicas", "maxRestarts", "nProcPerNode", *_IGNORED_RDZV),
        path,
    )
    low = _count(reader, elastic.get("minReplicas"), f"{path}.minReplicas", nodes)
    high = _count(reader, elastic.get("maxReplicas"), f"{path}.maxReplicas", max(nodes, low))
    if low > high:
        raise spec_error(
            reader.source,
            path,
            f"minReplicas {low} is above maxReplicas {high}",
            "Give minReplicas <= maxReplicas",
        )
    nproc = elastic.get("nProcPerNode") or spec.get("nprocPerNode") or 1
    if not re.fullmatch(r"[1-9]\d*|auto|cpu|gpu", str(nproc)):
        where = f"{path}.nProcPerNode" if elastic.get("nProcPerNode") else "spec.nprocPerNode"
        raise spec_error(
            reader.source, where, f"{nproc!r} is not a process count", "Give 1, 2, ... or auto"
        )
    flags = {"--nnodes": f"{low}:{high}" if low != high else str(low)}
    flags["--nproc-per-node"] = str(nproc)
    if elastic.get("maxRestarts") is not None:
        flags["--max-restarts"] = str(
            _count(reader, elastic["maxRestarts"], f"{path}.maxRestarts", 0, least=0)
        )
    conf = _rdzv_conf(reader, elastic.get("rdzvConf"), f"{path}.rdzvConf")
    if conf:
        flags["--rdzv-conf"] = conf
    return flags, high


def _count(reader: _Reader, value: object, path: str, default: int, least: int = 1) -> int:
    """A whole number field (`default` when absent), at least `least`."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise spec_error(
            reader.source, path, f"{value!r} is not a whole number >= {least}", "Fix the value"
        )
    return value


def _rdzv_conf(reader: _Reader, conf: object, path: str) -> str:
    """`rdzvConf` ([{key, value}]) as --rdzv-conf; the master's rendezvous reads its timeouts
    (join_timeout, last_call_timeout) and ignores the keys of torch's own backends."""
    if conf is None:
        return ""
    if not isinstance(conf, list):
        raise spec_error(
            reader.source, path, f"expected a list, got {kind_of(conf)}", "Use [{key, value}]"
        )
    items = []
    for i, item in enumerate(conf):
        item = reader.mapping(item, f"{path}[{i}]")
        reader.known(item, ("key", "value"), f"{path}[{i}]")
        items.append(f"{item.get('key')}={item.get('value', '')}")
    return ",".join(items)


def _under_dlrover_run(
    reader: _Reader, command: tuple[str, ...], flags: dict[str, str], path: str
) -> tuple[str, ...]:
    """The container command run by dlrover-run: torchrun's flags kept, the elastic policy's
    added where the command does not give them; a plain `python script.py` wrapped."""
    launcher_args: tuple[str, ...] = ()
    rest = command
    for launcher in (*_TORCH_LAUNCHERS, _DLROVER_RUN, ("dlrover-run",)):
        if command[: len(launcher)] == launcher:
            after = command[len(launcher) :]
            script_at = _script_index(after)
            launcher_args, rest = after[:script_at], after[script_at:]
            break
    else:
        if command[0] not in ("python", "python3") or len(command) < 2:
            raise spec_error(
                reader.source,
                f"{path}.template.spec.containers[0].command",
                f"{' '.join(command)!r} is not a Python program dlrover-run can start",
                "Make the command `python train.py ...`, `python -m module ...` or "
                "`torchrun [flags] train.py ...`",
            )
        rest = command[1:]
    given = {a.split("=")[0].replace("_", "-") for a in launcher_args if a.startswith("--")}
    added: list[str] = []
    for flag, value in flags.items():
        if flag not in given:
            added += [flag, value]
    return (*_DLROVER_RUN, *added, *launcher_args, *rest)


def _script_index(args: tuple[str, ...]) -> int:
    """Where the script (or `-m module`) starts in a launcher's arguments."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-m", "--module") or not arg.startswith("-"):
            return i
        if "=" not in arg and arg.replace("_", "-") not in _FLAGS_WITHOUT_VALUE:
            i += 1  # the flag's value
        i += 1
    return len(args)


def _replace(group: NodeGroupSpec, **changes: Any) -> NodeGroupSpec:
    return dataclasses.replace(group, **changes)


_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|K|M|G|T)?$")
_MEMORY_MB = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
_MEMORY_MB |= {"k": 1e3 / 2**20, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
_MEMORY_MB |= {"T": 1e12 / 2**20, "": 1 / 2**20}


class _Reader:
    """The checks shared by both kinds; every error names the manifest path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def mapping(self, value: object, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise spec_error(
                self.source,
                path,
                f"expected a mapping, got {kind_of(value)}",
                "Fix its indentation",
            )
        return value

    def known(self, data: Mapping[str, Any], fields: tuple[str, ...], path: str) -> None:
        for key in data:
            if key not in fields:
                where = f"{path}.{key}" if path else str(key)
                raise spec_error(
                    self.source,
                    where,
                    "not supported by dlrover",
                    f"Remove it (supported here: {', '.join(fields)})",
                )

    def replica(self, replica: object, path: str) -> tuple[NodeGroupSpec, str]:
        """One replica spec as a node group (the container's command, env, resources)."""
        replica = self.mapping(replica, path)
        self.known(replica, ("replicas", "restartPolicy", "template"), path)
        restart = replica.get("restartPolicy", "OnFailure")
        if restart not in _RESTART_POLICIES:
            raise spec_error(
                self.source,
                f"{path}.restartPolicy",
                f"{restart!r} is not a restart policy",
                f"Use one of: {', '.join(_RESTART_POLICIES)}",
            )
        template = self.mapping(replica.get("template"), f"{path}.template")
        self.known(template, ("metadata", "spec"), f"{path}.template")
        pod = self.mapping(template.get("spec"), f"{path}.template.spec")
        self.known(pod, ("containers", "restartPolicy"), f"{path}.template.spec")
        containers = pod.get("containers")
        cpath = f"{path}.template.spec.containers"
        if not isinstance(containers, list) or len(containers) != 1:
            raise spec_error(
                self.source,
                cpath,
                f"expected one container, got {kind_of(containers)}"
                + (f" of {len(containers)}" if isinstance(containers, list) else ""),
                "Give the replica exactly one container (sidecars are not supported)",
            )
        container = self.mapping(containers[0], f"{cpath}[0]")
        cpath += "[0]"
        self.known(container, tuple(sorted(_CONTAINER_FIELDS)), cpath)
        command = list(container.get("command") or [])
        if not command:
            raise spec_error(
                self.source,
                f"{cpath}.command",
                "missing: dlrover starts the command itself (locally there is no image "
                "entrypoint to run)",
                "Give the container's command, e.g. [python, /app/train.py]",
            )
        command += list(container.get("args") or [])
        group = NodeGroupSpec(
            replicas=replica.get("replicas", 1),
            max_relaunches=0 if restart == "Never" else NodeGroupSpec.max_relaunches,
            command=tuple(str(c) for c in command),
            env=self._env(container.get("env") or [], f"{cpath}.env"),
            image=container.get("image", ""),
            image_workdir=container.get("workingDir", ""),
            **self._resources(container.get("resources") or {}, f"{cpath}.resources"),
        )
        return group, path

    def _env(self, env: object, path: str) -> dict[str, str]:
        if not isinstance(env, list):
            raise spec_error(
                self.source, path, f"expected a list, got {kind_of(env)}", "Use [{name, value}]"
            )
        out: dict[str, str] = {}
        for i, item in enumerate(env):
            item = self.mapping(item, f"{path}[{i}]")
            if "valueFrom" in item:
                raise spec_error(
                    self.source,
                    f"{path}[{i}].valueFrom",
                    "not supported by dlrover (no secrets or field references in node env)",
                    "Give the value itself, or read it in the program",
                )
            self.known(item, ("name", "value"), f"{path}[{i}]")
            out[str(item.get("name"))] = str(item.get("value", ""))
        return out

    def _resources(self, res: object, path: str) -> dict[str, Any]:
        res = self.mapping(res, path)
        self.known(res, ("requests", "limits"), path)
        # dlrover sets requests = limits: the limits win, else the requests.
        merged = {**res.get("requests", {}), **res.get("limits", {})}
        out: dict[str, Any] = {}
        for key, value in merged.items():
            text = str(value)
            if key == "cpu" and (m := _CPU.match(text)):
                out["cpu"] = float(m.group(1)) / (1000 if m.group(2) else 1)
            elif key == "memory" and (m := _MEMORY.match(text)):
                out["memory_mb"] = max(1, round(float(m.group(1)) * _MEMORY_MB[m.group(2) or ""]))
            else:
                raise spec_error(
                    self.source,
                    f"{path}.{key}",
                    f"{key}: {text!r} is not supported by dlrover",
                    "Give cpu (e.g. 2 or 500m) and memory (e.g. 4Gi) only",
                )
        return out
