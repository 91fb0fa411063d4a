"""The committed stubs must equal what protoc generates from proto/ now."""

import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_match_proto(tmp_path):
    # protoc runs in a subprocess: it must never share a process with TensorFlow.
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = tmp_path / "master" / "pb"
    committed = ROOT / "master" / "pb"
    generated = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
    assert generated, "protoc generated nothing"
    for name in generated:
        assert (committed / name).exists(), f"{name} is not committed; run `make proto`"
        assert filecmp.cmp(fresh / name, committed / name, shallow=False), (
            f"master/pb/{name} differs from proto/; run `make proto` and commit"
        )
    stale = {p.name for p in committed.glob("*_pb2*.py*")} - set(generated)
    assert not stale, f"stubs without a .proto: {stale}"
