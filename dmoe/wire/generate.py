"""Regenerates the Python stubs in this folder from ``proto/dmoe.proto``.

Run ``python -m dmoe.wire.generate`` after editing the proto; ``tests/test_wire.py`` fails while the committed
stubs differ from what this produces. The proto is mapped to the virtual path ``dmoe/wire/dmoe.proto`` so the
generated gRPC module imports its messages as ``from dmoe.wire import dmoe_pb2`` (a package import).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("dmoe_pb2.py", "dmoe_pb2.pyi", "dmoe_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Runs protoc into ``out_root`` and returns the paths of the generated files."""
    from grpc_tools import protoc  # dev dependency: only needed when regenerating

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-Idmoe/wire={ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        "dmoe/wire/dmoe.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / "dmoe" / "wire" / name for name in GENERATED]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = ROOT / "dmoe" / "wire" / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
