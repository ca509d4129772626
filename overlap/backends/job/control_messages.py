"""The control messages ranks of a job send each other (a failure, a rank leaving, a rank
exiting, "how far did you get?" and its answer): their kinds, their fields, and how they go
into and out of bytes.

A message is a JSON object of exactly its kind's fields, each of its type — plain data:
nothing a peer sends is ever unpickled or executed, and anything else (another shape, a bool
where an int belongs, more than :data:`MAX_MESSAGE_BYTES`, JSON nested past the parser's
recursion limit) is no message at all.
"""

from __future__ import annotations

import enum
import json
from typing import Any


class ControlTag(enum.IntEnum):
    """A control message's kind: its MPI tag, or its tag on the control links channel."""

    FAILED = 1  # a rank's call failed: {rank, during, error, calls}
    EXITING = 2  # a rank is about to exit: {rank}
    QUERY = 3  # how far did you get? {}
    REPLY = 4  # the answer: {calls, busy}
    LEFT = 5  # a rank left the job: {rank, calls, how}


# What each kind carries: field -> type.
FIELDS: dict[int, dict[str, type]] = {
    ControlTag.FAILED: {"rank": int, "during": str, "error": str, "calls": int},
    ControlTag.EXITING: {"rank": int},
    ControlTag.QUERY: {},
    ControlTag.REPLY: {"calls": int, "busy": bool},
    ControlTag.LEFT: {"rank": int, "calls": int, "how": str},
}
MAX_MESSAGE_BYTES = 1 << 16  # a control message is a few hundred


def encode_control(msg: dict[str, Any]) -> bytes:
    """The bytes of a control message (JSON)."""
    return json.dumps(msg).encode()


def parse_control(tag: int, data: bytes) -> dict[str, Any] | None:
    """A control message, if ``data`` is one of the kind ``tag`` says (else None)."""
    fields = FIELDS.get(tag)
    if fields is None or len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(msg, dict) or set(msg) != set(fields):
        return None
    if not all(type(msg[k]) is t for k, t in fields.items()):
        return None
    return msg


__all__ = ["FIELDS", "MAX_MESSAGE_BYTES", "ControlTag", "encode_control", "parse_control"]
