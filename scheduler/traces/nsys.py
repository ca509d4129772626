"""Reading an Nsight Systems SQLite export into a :class:`~scheduler.traces.capture.Capture`:
its GPU work attributed to the runtime's NVTX ranges, and its training steps (see
:mod:`scheduler.traces.capture` for what attribution and steps mean).

Tables, per the "SQLite Export Schema Reference" of Nsight Systems (read by column name; a
table missing from a capture — they are created lazily — is read as empty):

- ``StringIds(id, value)``: interned strings;
- ``NVTX_EVENTS``: ranges — ``eventType`` 59 push/pop, 60 start/end — with ``start``,
  ``end``, ``globalTid`` (the thread), ``text`` inline or ``textId`` into ``StringIds``, and
  ``domainId``; a row of ``eventType`` 75 creates a domain (its name in ``text``, its id in
  ``domainId``);
- ``CUPTI_ACTIVITY_KIND_RUNTIME``: CUDA API calls — ``start``, ``globalTid``,
  ``correlationId``;
- ``CUPTI_ACTIVITY_KIND_KERNEL`` / ``_MEMCPY`` / ``_MEMSET``: GPU work — ``start``, ``end``,
  ``deviceId``, ``correlationId`` (joining it to its launch call); kernels name themselves by
  ``shortName`` or ``demangledName`` (ids into ``StringIds``) and are classed by that name,
  memcpy and memset rows are memory work (:mod:`scheduler.traces.gpu_time`). Synchronization rows
  (``CUPTI_ACTIVITY_KIND_SYNCHRONIZATION``) are not read.

Times are nanoseconds in the export, on one clock for host and GPU.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from ..intervals import check_id, check_interval
from .capture import STEP, Capture, classify, innermost, step_windows

NVTX_PUSH_POP, NVTX_START_END, NVTX_DOMAIN_CREATE = 59, 60, 75
DOMAIN = "overlap"
# GPU work's tables -> what they record (scheduler.traces.gpu_time.ACTIVITIES: a memcpy or memset
# is memory work whatever its name; a kernel is classed by its name).
_GPU_TABLES = {"CUPTI_ACTIVITY_KIND_KERNEL": "kernel", "CUPTI_ACTIVITY_KIND_MEMCPY": "memcpy",
               "CUPTI_ACTIVITY_KIND_MEMSET": "memset"}


def read_sqlite(path: str | Path) -> Capture:
    """Every kernel, memcpy and memset of the capture, attributed, and its steps.
    ValueError naming the file when it is not an Nsight Systems SQLite export."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if not is_sqlite(path):
        raise ValueError(f"{path}: not an SQLite file (an Nsight Systems capture exports "
                         "to one with `nsys export --type sqlite`)")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return _attribute(db)
        except (TypeError, KeyError) as exc:  # (a NULL or odd value where a number belongs)
            raise ValueError(f"{path}: a row of unexpected values ({type(exc).__name__}: "
                             f"{exc})") from None
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{path}: a corrupt or unreadable SQLite file ({exc})") from None


MAX_ROWS = 5_000_000  # rows read from one table (a long capture has ~1e6 kernels)


def _rows(db: sqlite3.Connection, table: str, columns: Sequence[str]) -> list[tuple]:
    """``columns`` of ``table`` (None for a column this version lacks); [] without it. A
    table is read whole only when it is a plain table of at most :data:`MAX_ROWS` rows: a
    view (whose query could run without end) or a bigger table is named instead."""
    kind = db.execute("SELECT type FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    if kind is None:
        return []
    if kind[0] != "table":
        raise ValueError(f"{table} is a {kind[0]}, not a table: an Nsight Systems export has "
                         "tables (a view's query is not read)")
    have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
    picked = ", ".join(c if c in have else "NULL" for c in columns)
    rows = db.execute(f"SELECT {picked} FROM {table} LIMIT {MAX_ROWS + 1}").fetchall()
    if len(rows) > MAX_ROWS:
        raise ValueError(f"{table} has more than {MAX_ROWS} rows: more than this report reads "
                         "(capture a shorter window: overlap profile --steps A:B)")
    return rows


def _attribute(db: sqlite3.Connection) -> Capture:
    strings = dict(_rows(db, "StringIds", ("id", "value")))
    events = _rows(db, "NVTX_EVENTS", ("start", "end", "eventType", "globalTid", "text",
                                       "textId", "domainId"))
    domains = {dom for _, _, kind, _, text, tid, dom in events
               if kind == NVTX_DOMAIN_CREATE and (text or strings.get(tid)) == DOMAIN}
    # Per thread: our op ranges, sorted by start, for the innermost-enclosing lookup; step
    # ranges apart (they time steps, they own no work).
    ranges: dict[int, list[tuple[int, int, str]]] = {}
    steps = []
    for start, end, kind, tid, text, text_id, dom in events:
        if kind in (NVTX_PUSH_POP, NVTX_START_END) and dom in domains and end is not None:
            message = text or strings.get(text_id, "")
            _check_ns(start, end, f"NVTX_EVENTS row ({str(message)[:60]!r})")
            if STEP.match(message):
                steps.append((message, start * 1e-9, end * 1e-9))
            else:
                ranges.setdefault(tid, []).append((start, end, message))
    for rs in ranges.values():
        rs.sort()
    launches = {corr: (tid, start) for start, tid, corr in
                _rows(db, "CUPTI_ACTIVITY_KIND_RUNTIME", ("start", "globalTid", "correlationId"))}
    work = []
    for table, activity in _GPU_TABLES.items():
        for start, end, device, corr, short, demangled in _rows(
                db, table, ("start", "end", "deviceId", "correlationId", "shortName",
                            "demangledName")):
            name = strings.get(short) or strings.get(demangled) or table.rsplit("_", 1)[1].lower()
            launch = launches.get(corr)
            label = innermost(ranges.get(launch[0], []), launch[1]) if launch else None
            what = f"{table} row ({name!r})"
            _check_ns(start, end, what)
            gpu = 0 if device is None else check_id(device, what, "deviceId")
            work.append(classify(label, name, gpu, start * 1e-9, end * 1e-9, what, activity))
    return Capture(tuple(work), step_windows(steps))


def _check_ns(start: object, end: object, what: str) -> None:
    """ValueError naming ``what`` unless ``start`` and ``end`` are integer nanoseconds of
    an interval within a capture (:func:`~scheduler.intervals.check_interval`)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        raise ValueError(f"{what}: start {start!r}, end {end!r}: not integer nanoseconds")
    check_interval(start * 1e-9, end * 1e-9, what)  # type: ignore[operator]


def is_sqlite(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False
