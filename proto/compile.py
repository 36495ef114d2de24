"""Regenerates the Python stubs of proto/tpserve/v1/*.proto into tpserve/v1/.

Usage: python proto/compile.py [--out DIR]   (DIR defaults to the repository root)

The stubs are committed so that installing tpserve needs no protoc;
tests/test_proto_stubs.py regenerates them into a temporary directory and fails
when the committed ones differ (stale). Needs grpcio-tools (the `test` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / "tpserve" / "v1").glob("*.proto"))


def compile_protos(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) and returns the generated files.

    Raises:
        RuntimeError: protoc failed.
    """
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "tpserve" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    for path in compile_protos(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
