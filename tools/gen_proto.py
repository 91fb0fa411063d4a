"""Regenerate the committed gRPC stubs from proto/ into an output root.

Run in its own process: grpc_tools must not share a process with TensorFlow.
The `master/pb=proto` mapping makes the generated modules import each other as
`master.pb.X_pb2`, so they work as a package.
"""

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(out_root: str) -> int:
    out = pathlib.Path(out_root)
    (out / "master" / "pb").mkdir(parents=True, exist_ok=True)
    protos = sorted(p.name for p in (ROOT / "proto").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{include}",
        f"-Imaster/pb={ROOT / 'proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[f"master/pb/{name}" for name in protos],
    ]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT)))
