"""Job spec loading and validation: the example loads; bad input names file, field and fix."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest

from master.config import (
    NODE_TYPES,
    JobSpec,
    MasterConfig,
    NodeGroupSpec,
    SpecError,
    load_job_spec,
    parse_job_spec,
)

EXAMPLE = """\
name: wide-deep
command: [python, wide_deep.py, --epochs, "2"]
env: {TF_CPP_MIN_LOG_LEVEL: "2"}
ps: {replicas: 1}
chief: {replicas: 1}
worker: {replicas: 2, max_relaunches: 2}
evaluator: {replicas: 0}
max_relaunches: 6
heartbeat_timeout_seconds: 10
"""

MINIMAL = "name: j\ncommand: python train.py\nworker: {replicas: 1}\n"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_job_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message
    return message


def test_example_loads(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    spec = load_job_spec(path)
    assert spec.name == "wide-deep"
    assert spec.command == ("python", "wide_deep.py", "--epochs", "2")
    assert spec.env == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    assert spec.ps == NodeGroupSpec(replicas=1)
    assert spec.chief.replicas == 1
    assert spec.worker.replicas == 2 and spec.worker.max_relaunches == 2
    assert spec.evaluator.replicas == 0
    assert spec.max_relaunches == 6
    assert spec.heartbeat_timeout_seconds == 10.0
    assert isinstance(spec.heartbeat_timeout_seconds, float)
    assert spec.evaluator_grace_seconds == 60.0
    assert spec.workdir == str(tmp_path)
    assert spec.source == str(path)
    assert [spec.group(t) for t in NODE_TYPES] == [
        spec.ps,
        spec.chief,
        spec.worker,
        spec.evaluator,
    ]


def test_defaults_and_string_command(tmp_path: Path) -> None:
    text = "name: j\ncommand: python 'my script.py' -x\nchief: {replicas: 1}\nps:\n"
    spec = load_job_spec(write(tmp_path, text))
    assert spec.command == ("python", "my script.py", "-x")
    assert spec.ps == NodeGroupSpec()  # 'ps:' with no value means defaults
    spec = load_job_spec(write(tmp_path, MINIMAL))
    assert spec.ps == NodeGroupSpec() and spec.chief == NodeGroupSpec()
    assert spec.env == {} and spec.max_relaunches == 10


def test_group_fields(tmp_path: Path) -> None:
    spec = load_job_spec(
        write(
            tmp_path,
            """\
            name: j
            command: [python, train.py]
            env: {A: "1", B: 2, C: 0.5}
            ps:
              replicas: 2
              command: [python, -m, my_ps]
              env: {A: override}
              cpu: 4
              memory_mb: 2048
              max_relaunches: 0
            worker: {replicas: 3}
            evaluator_grace_seconds: 0
            """,
        )
    )
    assert spec.env == {"A": "1", "B": "2", "C": "0.5"}
    assert spec.ps == NodeGroupSpec(
        replicas=2,
        max_relaunches=0,
        command=("python", "-m", "my_ps"),
        env={"A": "override"},
        cpu=4.0,
        memory_mb=2048,
    )
    assert spec.evaluator_grace_seconds == 0.0


@pytest.mark.parametrize(
    ("workdir", "expected"),
    [
        (None, "."),
        ("data", "data"),
        ("../elsewhere/./x", "../elsewhere/x"),
        ("/abs/dir", "/abs/dir"),
    ],
)
def test_workdir_resolved_against_yaml_dir(tmp_path: Path, workdir: str | None, expected: str):
    spec_dir = tmp_path / "jobs"
    spec_dir.mkdir()
    text = MINIMAL + (f"workdir: {workdir}\n" if workdir is not None else "")
    spec = load_job_spec(write(spec_dir, text))
    assert spec.workdir == os.path.normpath(os.path.join(spec_dir, expected))
    assert os.path.isabs(spec.workdir)


def test_workdir_independent_of_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "jobs").mkdir()
    write(tmp_path / "jobs", MINIMAL + "workdir: data\n")
    monkeypatch.chdir(tmp_path)
    spec = load_job_spec("jobs/job.yaml")
    assert spec.workdir == str(tmp_path / "jobs" / "data")


@pytest.mark.parametrize(
    ("text", "field", "problem", "fix"),
    [
        (
            MINIMAL + "wroker: {replicas: 1}\n",
            "wroker",
            "unknown field 'wroker' (did you mean 'worker'?)",
            "Rename it to 'worker'",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, replcas: 2}\n",
            "worker.replcas",
            "(did you mean 'replicas'?)",
            "Rename it to 'replicas'",
        ),
        (
            MINIMAL + "zzz: 1\n",
            "zzz",
            "unknown field 'zzz'",
            "known fields here are: name, command",
        ),
        (
            MINIMAL + "source: x.yaml\n",
            "source",
            "unknown field 'source'",
            "Remove it",
        ),
        (
            "name: j\ncommand: [python, 2]\nworker: {replicas: 1}\n",
            "command[1]",
            "expected a string, got a number 2",
            'Quote it in the YAML: "2"',
        ),
        (
            "name: j\ncommand: {a: b}\nworker: {replicas: 1}\n",
            "command",
            "expected a list of strings or a string",
            "Use e.g. [python, train.py",
        ),
        (
            "name: j\ncommand: []\nworker: {replicas: 1}\n",
            "command",
            "is empty",
            "Give the program to run",
        ),
        (
            'name: j\ncommand: "python \'unclosed"\nworker: {replicas: 1}\n',
            "command",
            "cannot split the command string",
            "Fix the quoting",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, command: [x, [y]]}\n",
            "worker.command[1]",
            "expected a string, got a list",
            "Make every item a plain string",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: -1}\n",
            "worker.replicas",
            "-1 is negative",
            "Use a number >= 0",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: two}\n",
            "worker.replicas",
            "expected a whole number, got a string 'two'",
            "Use e.g. 2",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: true}\n",
            "worker.replicas",
            "expected a whole number, got a boolean",
            "Use e.g. 2",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, max_relaunches: -2}\n",
            "worker.max_relaunches",
            "-2 is negative",
            "Use a number >= 0",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, cpu: 500m}\n",
            "worker.cpu",
            "expected a number",
            "a number of cores",
        ),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, memory_mb: -5}\n",
            "worker.memory_mb",
            "-5 is negative",
            "Use a number >= 0",
        ),
        (
            "name: j\ncommand: a\nchief: {replicas: 2}\n",
            "chief.replicas",
            "at most one chief",
            "put the other replicas in worker.replicas",
        ),
        (
            "name: j\ncommand: a\nps: {replicas: 1}\nchief: {replicas: 0}\n",
            "chief.replicas, worker.replicas",
            "no chief and no worker",
            "Set 'chief: {replicas: 1}'",
        ),
        ("command: a\nworker: {replicas: 1}\n", "name", "missing", "Add 'name: my-job'"),
        ("name: j\nworker: {replicas: 1}\n", "command", "missing", "Add 'command: [python"),
        (
            "name: Wide_Deep\ncommand: a\nworker: {replicas: 1}\n",
            "name",
            "'Wide_Deep' is not a valid job name: it becomes part of pod names",
            "Rename it, e.g. 'wide-deep'",
        ),
        (
            f"name: {'a' * 64}\ncommand: a\nworker: {{replicas: 1}}\n",
            "name",
            "at most 63 characters",
            f"Rename it, e.g. '{'a' * 63}'",
        ),
        (
            "name: 12\ncommand: a\nworker: {replicas: 1}\n",
            "name",
            "expected a string, got a number",
            "Use e.g. 'name: my-job'",
        ),
        (
            MINIMAL + "env: {A: {nested: 1}}\n",
            "env.A",
            "expected a string, got a mapping",
            "quote or flatten it",
        ),
        (
            MINIMAL + "env: {A: [1, 2]}\n",
            "env.A",
            "expected a string, got a list",
            "quote or flatten it",
        ),
        (
            MINIMAL + "env: {DEBUG: true}\n",
            "env.DEBUG",
            "a boolean (True) is ambiguous",
            'Quote the value you mean, e.g. "true"',
        ),
        (MINIMAL + "env: {A: }\n", "env.A", "has no value", 'or "" for empty'),
        (MINIMAL + "env: [A, B]\n", "env", "expected a mapping", "{NAME: value, ...}"),
        (
            "name: j\ncommand: a\nworker: {replicas: 1, env: {X: {y: z}}}\n",
            "worker.env.X",
            "expected a string, got a mapping",
            "quote or flatten it",
        ),
        (
            MINIMAL + "heartbeat_timeout_seconds: -1\n",
            "heartbeat_timeout_seconds",
            "-1 is negative",
            "Use a positive number of seconds",
        ),
        (
            MINIMAL + "heartbeat_timeout_seconds: 0\n",
            "heartbeat_timeout_seconds",
            "0 would time out at once",
            "Use a positive number of seconds",
        ),
        (
            MINIMAL + "evaluator_grace_seconds: -0.5\n",
            "evaluator_grace_seconds",
            "-0.5 is negative",
            "Use a number of seconds >= 0",
        ),
        (
            MINIMAL + "max_relaunches: -1\n",
            "max_relaunches",
            "-1 is negative",
            "Use a number >= 0",
        ),
        (
            "name: j\ncommand: a\nchief: {replicas: 1}\nworker: 3\n",
            "worker",
            "expected a mapping, got a number",
            "Write it as 'worker: {replicas: 1}'",
        ),
        (
            MINIMAL + "workdir: 5\n",
            "workdir",
            "expected a directory path, got a number",
            "Use a path such as",
        ),
        (
            "- name: j\n",
            "(top level)",
            "expected a mapping of fields, got a list",
            "'field: value' lines",
        ),
    ],
)
def test_errors_name_file_field_and_fix(
    tmp_path: Path, text: str, field: str, problem: str, fix: str
) -> None:
    message = load_error(tmp_path, text)
    path = tmp_path / "job.yaml"
    assert message.startswith(f"{path}: {field}: "), message
    assert problem in message, message
    assert fix in message, message
    assert message.endswith("."), message


def test_error_carries_source_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\ncommand: a\nworker: {replicas: -1}\n")
    with pytest.raises(SpecError) as info:
        load_job_spec(path)
    assert info.value.source == str(path)
    assert info.value.field == "worker.replicas"
    assert isinstance(info.value, ValueError)


def test_malformed_yaml_gives_line_and_column(tmp_path: Path) -> None:
    message = load_error(tmp_path, "name: j\ncommand: [python, x\nworker: {replicas: 1}\n")
    assert ": line 3, column " in message
    assert "malformed YAML" in message and "Fix the YAML syntax" in message

    message = load_error(tmp_path, "name: j\n  bad indent: 1\n")
    assert ": line 2, column " in message and "malformed YAML" in message


def test_duplicate_key_is_rejected(tmp_path: Path) -> None:
    message = load_error(tmp_path, "name: j\ncommand: a\nworker: {replicas: 1}\nname: k\n")
    assert "line 4, column 1" in message
    assert "duplicate key 'name'" in message and "Keep only one of them" in message


def test_missing_empty_and_directory_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match=r"nope\.yaml: job spec file not found\. Check the path"):
        load_job_spec(missing)
    with pytest.raises(SpecError, match="is a directory"):
        load_job_spec(tmp_path)
    message = load_error(tmp_path, "")
    assert "the job spec is empty" in message and "Write at least 'name: my-job'" in message
    message = load_error(tmp_path, "just a string\n")
    assert "(top level): expected a mapping of fields, got a string" in message


def test_parse_job_spec_from_object(tmp_path: Path) -> None:
    data = {"name": "j", "command": ["a"], "worker": {"replicas": 1}, "workdir": "w"}
    spec = parse_job_spec(data, "<flags>", str(tmp_path))
    assert spec.workdir == str(tmp_path / "w")
    assert spec.source == "<flags>"
    with pytest.raises(SpecError, match=r"^<flags>: worker\.replicas: -1 is negative"):
        parse_job_spec({**data, "worker": {"replicas": -1}}, "<flags>", str(tmp_path))


def test_with_overrides_revalidates(tmp_path: Path) -> None:
    spec = load_job_spec(write(tmp_path, EXAMPLE))
    bigger = spec.with_overrides(worker=dataclasses.replace(spec.worker, replicas=5))
    assert bigger.worker.replicas == 5 and bigger.worker.max_relaunches == 2
    assert spec.worker.replicas == 2  # the original is unchanged
    assert spec.with_overrides(command="python other.py").command == ("python", "other.py")
    with pytest.raises(SpecError, match=r"job\.yaml: chief\.replicas: 3 chiefs"):
        spec.with_overrides(chief=NodeGroupSpec(replicas=3))
    with pytest.raises(SpecError, match=r"job\.yaml: worker\.replicas: -1 is negative"):
        spec.with_overrides(worker=NodeGroupSpec(replicas=-1))
    with pytest.raises(SpecError, match="heartbeat_timeout_seconds"):
        spec.with_overrides(heartbeat_timeout_seconds=-3)
    with pytest.raises(TypeError):
        spec.with_overrides(no_such_field=1)


def test_direct_construction_is_validated_and_normalised(tmp_path: Path) -> None:
    groups = {t: NodeGroupSpec() for t in NODE_TYPES}
    groups["worker"] = NodeGroupSpec(replicas=1, command=["python", "w.py"], env={"N": 3})
    spec = JobSpec(
        name="j", command=["python", "t.py"], workdir=str(tmp_path), env={"X": 1}, **groups
    )
    assert spec.command == ("python", "t.py")
    assert spec.env == {"X": "1"}
    assert spec.worker.command == ("python", "w.py") and spec.worker.env == {"N": "3"}
    assert spec.source == "<spec>"
    with pytest.raises(SpecError, match=r"^<spec>: workdir: 'rel' is not an absolute path"):
        JobSpec(name="j", command=("a",), workdir="rel", env={}, **groups)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "k"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown node type 'master'"):
        spec.group("master")


def test_master_config() -> None:
    config = MasterConfig()
    assert config.host == "127.0.0.1" and config.port == 0 and config.state_path == ":memory:"
    assert len(config.job_token) >= 32
    assert config.job_token != MasterConfig().job_token
    assert config.job_token not in repr(config)
    assert MasterConfig(job_token="given").job_token == "given"
    assert dataclasses.replace(config, port=1234).job_token == config.job_token
    with pytest.raises(ValueError, match="MasterConfig.port: 70000 is out of range"):
        MasterConfig(port=70000)
    with pytest.raises(ValueError, match="heartbeat_interval_seconds"):
        MasterConfig(heartbeat_interval_seconds=0)
    with pytest.raises(ValueError, match="max_workers"):
        MasterConfig(max_workers=0)


def test_max_replicas_default_and_validation(tmp_path):
    from master.config import SpecError, parse_job_spec

    base = {"name": "j", "command": ["x"]}
    spec = parse_job_spec(base | {"worker": {"replicas": 3}}, "job.yaml", str(tmp_path))
    assert spec.worker.slots == 6
    spec = parse_job_spec(
        base | {"worker": {"replicas": 1, "max_replicas": 8}}, "job.yaml", str(tmp_path)
    )
    assert spec.worker.slots == 8
    with pytest.raises(SpecError) as e:
        parse_job_spec(
            base | {"worker": {"replicas": 4, "max_replicas": 2}}, "job.yaml", str(tmp_path)
        )
    assert "worker.max_replicas" in str(e.value) and "below replicas (4)" in str(e.value)
