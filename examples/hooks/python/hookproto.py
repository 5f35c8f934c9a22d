"""Python stubs for the hookwire.v1 protocol, generated from the project's proto/.

The stubs are not committed: they are generated with grpcio-tools (which ships
its own protoc, so no system protoc is needed) into ./generated/ the first time
they are needed, and again whenever a .proto file is newer than them. Import
the generated modules through this file:

    from hookproto import common, pb, pb_grpc

Run `python3 hookproto.py` (or ./gen.sh) to regenerate by hand. Set
HOOKWIRE_PROTO_DIR when this directory is copied out of the hookwire tree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "generated"


def _proto_dir() -> Path:
    # The variable is read first: a copy of this directory outside the
    # hookwire tree may sit too shallow for the default to exist at all.
    if os.environ.get("HOOKWIRE_PROTO_DIR"):
        return Path(os.environ["HOOKWIRE_PROTO_DIR"])
    # In the tree: examples/hooks/python -> the repository's proto/.
    if len(HERE.parents) < 3:
        raise RuntimeError(
            f"{HERE} is not inside the hookwire tree: set HOOKWIRE_PROTO_DIR to a "
            "directory holding hookwire/v1/*.proto"
        )
    return HERE.parents[2] / "proto"


PROTO_DIR = _proto_dir()
# agent.proto (the client API) is not needed by a hook server.
PROTOS = ["hookwire/v1/common.proto", "hookwire/v1/hook.proto"]
STAMP = OUT / ".stamp"


def _stale() -> bool:
    if not STAMP.exists():
        return True
    built = STAMP.stat().st_mtime
    return any((PROTO_DIR / p).stat().st_mtime > built for p in PROTOS)


def generate(force: bool = False) -> None:
    """(Re)generate the stubs if they are missing or older than the protos."""
    from grpc_tools import protoc  # imported lazily: only needed to generate

    OUT.mkdir(exist_ok=True)
    # Several processes may start at once (tests start servers in parallel):
    # hold a lock so nobody imports a half-written module.
    with open(OUT / ".lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # not on Unix: no locking, generation is quick
            pass
        if not force and not _stale():
            return
        well_known = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={OUT}",
            f"--pyi_out={OUT}",  # type stubs, for editors
            f"--grpc_python_out={OUT}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR} (set HOOKWIRE_PROTO_DIR?)")
        STAMP.touch()


if not (PROTO_DIR / PROTOS[1]).exists():
    raise RuntimeError(f"{PROTO_DIR / PROTOS[1]} not found; set HOOKWIRE_PROTO_DIR")
if __name__ == "__main__" or _stale():
    generate(force=__name__ == "__main__")
# The generated modules import each other as `hookwire.v1.*`.
sys.path.insert(0, str(OUT))

from hookwire.v1 import common_pb2 as common  # noqa: E402
from hookwire.v1 import hook_pb2 as pb  # noqa: E402
from hookwire.v1 import hook_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["common", "pb", "pb_grpc", "generate"]

if __name__ == "__main__":
    print(f"generated {', '.join(PROTOS)} into {OUT}")
