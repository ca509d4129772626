"""Scheduling a callback on an event loop from whichever thread completes something.

Completions come from stream threads, the host-link thread — or, since the ``*_sync`` calls'
loop reads the host links itself, from that loop's own thread. ``call_soon_threadsafe`` from
the loop's own thread writes its self-pipe, and the loop then takes one more pass (a system
call each way and a pass of the loop: ~10 µs, twice a call on a rank of a tiny cross-process
resharding); a plain ``call_soon`` does the same job there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def call_soon_any_thread(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any],
                         *args: Any) -> None:
    """``loop.call_soon_threadsafe(fn, *args)``, or ``loop.call_soon`` on the thread running
    ``loop`` (no self-pipe write, no extra pass). Raises RuntimeError if ``loop`` is closed,
    as both do."""
    if asyncio._get_running_loop() is loop:
        loop.call_soon(fn, *args)
    else:
        loop.call_soon_threadsafe(fn, *args)
