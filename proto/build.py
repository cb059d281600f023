"""Generate the Python stubs of ``stage.proto`` with grpcio-tools.

``python -m ppspec.proto.build`` (run by ``make install``) writes ``stage_pb2.py`` and
``stage_pb2_grpc.py`` beside the ``.proto`` plus ``stubs.sha256``, the hash of the
``.proto`` they came from. ``ppspec.proto.stubs`` regenerates them when that hash is stale.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "stage.proto")
STAMP = os.path.join(HERE, "stubs.sha256")
OUTPUTS = ("stage_pb2.py", "stage_pb2_grpc.py")


def proto_hash() -> str:
    with open(PROTO, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def is_stale() -> bool:
    if not all(os.path.isfile(os.path.join(HERE, o)) for o in OUTPUTS) or not os.path.isfile(STAMP):
        return True
    with open(STAMP) as f:
        return f.read().strip() != proto_hash()


def build() -> None:
    """Run protoc so that the stubs import each other as ``ppspec.proto.*``.

    Raises:
        RuntimeError: grpcio-tools is missing or protoc failed.
    """
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError("generating the gRPC stubs needs grpcio-tools (pip install grpcio-tools)") from e
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        pkg = os.path.join(tmp, "ppspec", "proto")
        os.makedirs(pkg)
        shutil.copy(PROTO, pkg)
        rc = protoc.main(
            ["protoc", f"-I{tmp}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
             os.path.join(pkg, "stage.proto")]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
        for o in OUTPUTS:
            # write-then-rename: a concurrent importer never sees half a file
            fd, part = tempfile.mkstemp(dir=HERE, suffix=".part")
            with os.fdopen(fd, "wb") as dst, open(os.path.join(pkg, o), "rb") as src:
                dst.write(src.read())
            os.replace(part, os.path.join(HERE, o))
    with open(STAMP, "w") as f:
        f.write(proto_hash() + "\n")


def main() -> int:
    build()
    print(f"generated {', '.join(OUTPUTS)} from {PROTO}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
