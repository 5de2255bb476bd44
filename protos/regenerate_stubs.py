"""Regenerate the gRPC stubs from multipod.proto: `python -m multipod.protos.regenerate_stubs`.

The stubs are committed; tests/protos/test_stubs.py checks that regenerating changes nothing.
"""
from __future__ import annotations

import pathlib
import re
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
STUBS = ("multipod_pb2.py", "multipod_pb2.pyi", "multipod_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Run grpc_tools.protoc on multipod.proto, writing the stubs into out_dir."""
    from grpc_tools import protoc

    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "multipod.proto"),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    # protoc writes an absolute import ("import multipod_pb2"); the stubs live in a package.
    grpc_file = out_dir / "multipod_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(re.sub(r"^import multipod_pb2 as", "from multipod.protos import multipod_pb2 as",
                                text, flags=re.M))


def main() -> int:
    """Regenerate the committed stubs in place."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        for name in STUBS:
            (PROTO_DIR / name).write_text((pathlib.Path(tmp) / name).read_text())
    print("regenerated", ", ".join(STUBS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
