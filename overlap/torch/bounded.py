"""Running user code the runtime does not schedule (the shape probe's first forward) under
the same bound as any op: on a thread of its own, waited for at most the runtime's
``timeout``. A thread cannot be stopped from Python: one still running past the bound is
left behind (a daemon, so the process can still exit) and reported by the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_within(fn: Callable[[], T], seconds: float, name: str) -> tuple[bool, T | None]:
    """``(True, fn())`` when ``fn`` returns within ``seconds`` (what it raises is raised here,
    traceback kept); ``(False, None)`` when it is still running then."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # (handed to the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box["value"]
