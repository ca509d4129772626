"""``overlap trace report`` on malformed traces of every source it reads: one line
``error: ...`` and exit 2 — never a traceback, never a report of impossible figures (NaN,
infinite or negative durations, an end before its start, a time outside any capture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_errors import assert_one_line_error, run_overlap
from test_nsys import MS, capture


def _kineto(**kernel) -> dict:
    base = {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10.0, "dur": 5.0,
            "args": {"device": 0}}
    base.update(kernel)
    return {"traceEvents": [{k: v for k, v in base.items() if v is not _GONE}]}


_GONE = object()


def _ours(**event) -> dict:
    base = {"ph": "X", "name": "F s0 mb0", "pid": 0, "tid": 0, "ts": 0.0, "dur": 10.0,
            "args": {"stage": 0, "microbatch": 0, "kind": "F", "op": 0}}
    base.update(event)
    return {"traceEvents": [base]}


JSON_CASES = {
    "kineto-no-ts": (_kineto(ts=_GONE), r"event 0 \('gemm'\): its start is None"),
    "kineto-args-null": (_kineto(args=None), r"its args are None, not an object"),
    "kineto-nan": (_kineto(ts=float("nan")), r"its start is nan"),
    "kineto-infinite": (_kineto(dur=float("inf")), r"its end is inf"),
    "kineto-negative": (_kineto(dur=-7.0), r"ends .* before it starts"),
    "kineto-far": (_kineto(ts=1e300), r"not a time within a capture"),
    "ours-nan": (_ours(ts=float("nan")), r"its start is nan"),
    "ours-negative": (_ours(dur=-1.0), r"ends .* before it starts"),
    "ours-no-dur": (_ours(dur=_GONE), r"not a trace written by overlap"),
    # issue 46: ids that are no integers, times no float holds
    "ours-tid-true": (_ours(tid=True), r"its tid is True, not an integer"),
    "ours-pid-float": (_ours(pid=1.5), r"its pid is 1.5, not an integer"),
    "ours-stage-string": (_ours(args={"stage": "1", "microbatch": 0, "op": 0}),
                          r"its stage is '1', not an integer"),
    "ours-huge-ts": (_ours(ts=10**400), r"its start is 1000.*\(401 characters\), not a time "
                                         r"within a capture"),
    "kineto-tid-true": (_kineto(tid=True), r"event 0 \('gemm'\): its tid is True, not an "
                                           r"integer"),
    "kineto-device-float": (_kineto(args={"device": 2.5}), r"its args.device is 2.5"),
    "kineto-huge-ts": (_kineto(ts=10**400), r"its start is 1000.*not a time within a capture"),
    "kineto-week-long": (_kineto(dur=2e12), r"it lasts 2e\+06 s, longer than any capture"),
}


def _report(path: Path):
    return run_overlap("trace", "report", str(path))


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_a_malformed_json_trace_is_one_named_error(tmp_path, case):
    data, match = JSON_CASES[case]
    data = {"traceEvents": [{k: v for k, v in e.items() if v is not _GONE}
                            for e in data["traceEvents"]]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))  # (NaN and Infinity as JSON's non-standard literals)
    assert_one_line_error(_report(path), match)


def test_deeply_nested_json_is_one_named_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(_report(path), r"not a trace written by overlap: RecursionError")


@pytest.mark.parametrize("kernel, match", [
    ((None, 4 * MS, 2, 1, 1, 1), r"CUPTI_ACTIVITY_KIND_KERNEL row \('gemm'\): start None"),
    ((4 * MS, 1 * MS, 2, 1, 1, 1), r"ends .* before it starts"),
    ((-2**63, 2**63 - 1, 2, 1, 1, 1), r"CUPTI_ACTIVITY_KIND_KERNEL row \('gemm'\): it lasts "
                                      r"1.845e\+10 s, longer than any capture"),
    ((0, MS, 2.5, 1, 1, 1), r"its deviceId is 2.5, not an integer"),
])
def test_a_malformed_sqlite_row_is_one_named_error(tmp_path, kernel, match):
    path = tmp_path / "cap.sqlite"
    capture(path, strings=[(1, "gemm")], runtime=[(0, 1, 7, 1)], kernels=[kernel])
    assert_one_line_error(_report(path), match)


def test_a_view_over_an_endless_query_is_refused_not_read(tmp_path):
    import sqlite3

    path = tmp_path / "cap.sqlite"
    capture(path, strings=[(1, "gemm")], runtime=[(0, 1, 7, 1)], kernels=[])
    db = sqlite3.connect(path)
    db.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
    db.execute("CREATE VIEW CUPTI_ACTIVITY_KIND_KERNEL AS WITH RECURSIVE n(x) AS (SELECT 1 "
               "UNION ALL SELECT x + 1 FROM n) SELECT x AS start, x + 1 AS end, 0 AS deviceId, "
               "1 AS correlationId, 1 AS shortName, NULL AS demangledName FROM n")
    db.commit()
    db.close()
    assert_one_line_error(_report(path), r"CUPTI_ACTIVITY_KIND_KERNEL is a view, not a table")


def test_a_table_past_the_row_bound_is_named(tmp_path, monkeypatch):
    from scheduler.traces import nsys

    path = tmp_path / "cap.sqlite"
    capture(path, strings=[(1, "gemm")], runtime=[(0, 1, 7, 1)],
            kernels=[(k * MS, (k + 1) * MS, 2, 1, 1, 1) for k in range(5)])
    monkeypatch.setattr(nsys, "MAX_ROWS", 3)
    with pytest.raises(ValueError, match=r"CUPTI_ACTIVITY_KIND_KERNEL has more than 3 rows"):
        nsys.read_sqlite(path)


def test_a_json_trace_over_the_byte_limit_is_refused_before_it_is_read(tmp_path):
    from scheduler.traces.capture import MAX_TRACE_BYTES

    path = tmp_path / "big.json"
    with open(path, "wb") as f:  # (sparse: no disk used, nothing that could be parsed)
        f.truncate(MAX_TRACE_BYTES + 1)
    done = run_overlap("trace", "report", str(path), memory=1 << 30)
    assert_one_line_error(done, rf"^error: file: .*big.json is {MAX_TRACE_BYTES + 1} bytes; a "
                                rf"JSON trace is at most {MAX_TRACE_BYTES} \(64 MiB\)")
