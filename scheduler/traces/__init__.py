"""Profiles read back: the part of ``scheduler`` that reads files (and, for an ``.nsys-rep``,
runs ``nsys export``). The rest of ``scheduler`` is the pure compiler.

- :mod:`~scheduler.traces.capture`: GPU work from any profiler as one value
  (:class:`Capture`), attributed to the runtime's ranges, its step windows and figures;
  the capture window of ``overlap profile --steps`` (:func:`steps_window`).
- :mod:`~scheduler.traces.nsys`: an Nsight Systems SQLite export (read with ``sqlite3``).
- :mod:`~scheduler.traces.kineto`: a PyTorch profiler (Kineto) JSON trace.
- :mod:`~scheduler.traces.gpu_time`: GPU work classed as Holistic Trace Analysis does, and
  each GPU's temporal breakdown.
- :mod:`~scheduler.traces.report`: ``overlap trace report`` (any source; several files, one
  per rank); exports an ``.nsys-rep`` with ``nsys`` when it is on the PATH.
- :mod:`~scheduler.traces.plot`: ``overlap trace plot`` and :meth:`scheduler.Timeline.plot`
  (matplotlib).

The figures themselves (compute, exposed communication, waits) are defined once, for these
and for simulated timelines alike, in :mod:`scheduler.exposure`.
"""

from __future__ import annotations

from .capture import PROFILE_STEPS_ENV, Capture, GpuWork, steps_window

__all__ = ["PROFILE_STEPS_ENV", "Capture", "GpuWork", "steps_window"]
