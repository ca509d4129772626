"""The CPU backend keeps the host memory it frees, as a GPU's caching allocator keeps device
memory.

On the CPU the devices' memory is the process's heap (glibc's ``malloc``, under numpy and
torch alike). By default glibc hands the top of its heap back to the kernel once more than a
threshold of it is free, and that threshold follows the largest block freed so far. A step
whose peak moves — a split backward keeps ~one activation per layer between ``I`` and ``W``,
then frees it all — has its top trimmed after each step and every page of it faulted back in
by the next: 3,680 minor faults per split backward of a small GPT stage, ~10 % of its time
(``benchmarks/vs_plain_torch.py --split``). A stage thread's own arena (glibc gives each
thread one) also unmaps a whole heap of it once it is free: ~4,100 faults per zb-h1 step of a
2-stage GPT on the CPU backend, against ~830 for 1f1b. torch's CUDA caching allocator keeps
what it freed for the next step; the CPU backend asks glibc to do the same: blocks up to
:data:`MMAP_THRESHOLD` come from the heap, the heap's free top is not trimmed below
:data:`TRIM_THRESHOLD`, and an arena keeps :data:`TOP_PAD` free before it drops a heap (both
steps then fault ~0 pages).

It is a setting of the process, made once, when the first CPU backend is made. It is not made
where the user chose glibc's settings (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``
or ``MALLOC_TOP_PAD_`` in the environment), nor where ``malloc`` is not glibc's.
"""

from __future__ import annotations

import ctypes
import functools
import os

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# The largest block served from the heap: glibc's own ceiling for its moving threshold
# (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), which it refuses to exceed; larger blocks are
# mapped and unmapped per use, as by default.
MMAP_THRESHOLD = 32 << 20
# How much free heap top is kept: once set, glibc no longer moves either threshold.
TRIM_THRESHOLD = 1 << 30
# A thread's arena grows by heaps of 64 MiB and drops one (unmaps it) once it is all free,
# whatever the trim threshold; one is kept while it would leave less than this free.
TOP_PAD = 64 << 20
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache  # (two threads racing here both set the same values: harmless)
def keep_freed_host_memory() -> bool:
    """Ask glibc to keep freed heap memory for reuse (see module doc), once per process;
    True where it is in effect, False where it was not made (another allocator, or the
    user's own settings)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False  # (the user's choice stands)
    try:
        libc = ctypes.CDLL(None)  # (the process's own symbols: its C library's among them)
        libc.gnu_get_libc_version  # noqa: B018  (glibc's alone: the question asked)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # (not glibc: musl, macOS)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # The mmap threshold first: setting either one freezes both (glibc then stops moving
    # them), and a frozen default of 128 KiB would map every larger block per use.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                and mallopt(_M_TOP_PAD, TOP_PAD))


__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "USER_SETTINGS",
           "keep_freed_host_memory"]
