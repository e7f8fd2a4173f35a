"""Generate the protobuf and gRPC modules from proto/ into the source tree.

``-I proto`` makes a file at proto/asymptote/contracts/v1/x.proto generate
``asymptote/contracts/v1/x_pb2.py`` importing its siblings as
``asymptote.contracts.v1.*``: no import rewriting, and nothing importable as
a top-level ``proto`` package. Generated files are committed; a test
regenerates them into a temporary folder and fails if they differ.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: the repository root)
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    files = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for pkg in {out_dir / f.relative_to(PROTO_ROOT).parent for f in files}:
        for d in [pkg, *pkg.parents]:
            if d == out_dir or out_dir not in d.parents:
                break
            (d / "__init__.py").touch()
    stems = [out_dir / f.relative_to(PROTO_ROOT).with_suffix("") for f in files]
    return [p.with_name(p.name + ext) for p in stems for ext in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path.relative_to(out))
