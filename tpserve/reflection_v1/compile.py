"""Regenerates the gRPC server reflection v1 stubs (reflection_pb2*.py*) beside reflection.proto.

Usage: python tpserve/reflection_v1/compile.py [--out DIR]   (DIR defaults to the repository root)

The stubs are committed so that installing tpserve needs no protoc;
tests/test_reflection_v1.py regenerates them and fails when the committed ones are stale.
Needs grpcio-tools (the `test` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = "tpserve/reflection_v1/reflection.proto"


def compile_reflection_v1(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) on reflection.proto and returns the generated files.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{REPO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", PROTO]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "tpserve" / "reflection_v1").glob("reflection_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    for path in compile_reflection_v1(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
