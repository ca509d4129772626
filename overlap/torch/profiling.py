"""The runtime's ranges in PyTorch profiler traces.

Importing :mod:`overlap.torch` registers :func:`_record_start`/:func:`_record_end` as an NVTX
sink (:func:`overlap.nvtx.add_sink`): while a ``torch.profiler.profile`` is recording, every
op, transfer, wait and step of the runtime is also a ``record_function`` range — a
``user_annotation`` event in the trace, on the thread that launched the op's GPU work — which
``overlap trace report`` attributes exactly as it attributes an Nsight capture.

The runtime's ops run on its stream threads, and the PyTorch profiler records only the thread
that started it unless told otherwise: :func:`profiler` makes a ``torch.profiler.profile``
that records every thread (``profile_all_threads``) and the GPU when there is one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from ..nvtx import add_sink


def _record_start(message: str, category: str) -> Any:
    # The module-level flag (not the thread-local one): the profiler was started on the
    # caller's thread, the range opens on a stream thread.
    if not torch.autograd.profiler._is_profiler_enabled:
        return None  # (costs one attribute read when no profiler records)
    # torch's Chrome export names a range with any non-ASCII character "unknown" (seen with
    # torch 2.13): our arrows become "->".
    if not message.isascii():
        message = message.replace("→", "->").encode("ascii", "backslashreplace").decode()
    return torch.ops.profiler._record_function_enter_new(message, None)


def _record_end(handle: Any) -> None:
    torch.ops.profiler._record_function_exit(handle)


def profiler(**kwargs: Any) -> profile:
    """A ``torch.profiler.profile`` that sees the runtime: every thread, CPU and (when
    available) CUDA activity. Keyword arguments go to ``profile`` and override these."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    kwargs.setdefault("activities", activities)
    kwargs.setdefault("experimental_config", _ExperimentalConfig(profile_all_threads=True))
    return profile(**kwargs)


add_sink(_record_start, _record_end)
