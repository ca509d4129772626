"""Every thread's traceback, written by a C-level timer when the runtime's watch misses a look.

An op that holds Python's interpreter lock (GIL) — a C extension that does not release it —
freezes every other thread of the process, the runtime's watch included: nothing written in
Python can name it until it returns, and if it never does, the process just stops. CPython's
:mod:`faulthandler` has a timer thread that needs no interpreter lock: armed at each of the
watch's ticks for a timeout past the next one, it fires only if the watch could not run by
then, and writes every thread's Python traceback — the
stuck stage's frame among them — to a file. The runtime names the op itself when it returns.

``faulthandler``'s timer is one per process: arming it replaces one set elsewhere
(``faulthandler.dump_traceback_later``, pytest's ``faulthandler_timeout``), so it is opt-in
(``Runtime(hang_tracebacks=True)``), for one runtime of a process at a time.
"""

from __future__ import annotations

import faulthandler
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HangDump:
    """Arms the timer for ``seconds`` + ``grace`` at each of the watch's ticks."""

    file: Any  # an open file with a real descriptor (``fileno()``)
    grace: float

    def arm(self, seconds: float) -> None:
        faulthandler.dump_traceback_later(seconds + self.grace, repeat=False, file=self.file,
                                          exit=False)

    @staticmethod
    def disarm() -> None:
        faulthandler.cancel_dump_traceback_later()


def hang_dump(value: Any, timeout: float) -> HangDump | None:
    """The ``hang_tracebacks`` argument: False (off), True (standard error) or an open file
    with a descriptor. The grace past a tick is the runtime's ``timeout``."""
    if value is False or value is None:
        return None
    file = sys.stderr if value is True else value
    try:
        file.fileno()
    except (AttributeError, OSError, ValueError) as exc:
        raise TypeError(f"hang_tracebacks: expected True, False or an open file with a "
                        f"descriptor (fileno()), got {value!r}") from exc
    return HangDump(file, timeout)


__all__ = ["HangDump", "hang_dump"]
