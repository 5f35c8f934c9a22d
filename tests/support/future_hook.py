#!/usr/bin/env python3
"""The Python example hook server as if built against a newer hookwire.v1:
a test fixture for tests/evolution.rs, not an example to copy.

Every verdict it sends carries fields this repository's proto does not have:
one on HookVerdict itself (number 1000) and one inside the typed verdict
(number 1001). With FUTURE_ACTION=<event name> (e.g. run_start), its verdicts
for that event hold only an action this proto does not have (number 99 in
the event's verdict oneof). Flags and output are server.py's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples/hooks/python"))

import server  # noqa: E402
from hooklib import event_name  # noqa: E402
from hookproto import pb  # noqa: E402

# Tests look for these bytes in what the hook sends.
MARKER = b"field-from-a-newer-hookwire-v1"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand: the stubs cannot name it."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _with_unknown(message, number: int):
    """A copy of `message` that also carries unknown field `number`: parsing
    keeps unknown fields, and grpcio serialises them back out."""
    return type(message).FromString(message.SerializeToString() + _field(number, MARKER))


FUTURE_ACTION = os.environ.get("FUTURE_ACTION", "")


class FutureHookServer(server.HookServer):
    async def _answer(self, event, run, received):
        verdict = await super()._answer(event, run, received)
        kind = verdict.WhichOneof("verdict")
        if event_name(event.kind) == FUTURE_ACTION:
            # The typed verdict is present but holds nothing this proto knows.
            number = pb.HookVerdict.DESCRIPTOR.fields_by_name[kind].number
            base = pb.HookVerdict(seq=verdict.seq, reason="an action from a newer proto")
            return pb.HookVerdict.FromString(
                base.SerializeToString() + _field(number, _field(99, MARKER))
            )
        getattr(verdict, kind).CopyFrom(_with_unknown(getattr(verdict, kind), 1001))
        return _with_unknown(verdict, 1000)


server.HookServer = FutureHookServer
if __name__ == "__main__":
    server.main()
