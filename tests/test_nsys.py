"""Nsight Systems SQLite exports, built here following the documented schema, with exposed
communication known by construction."""

from __future__ import annotations

import sqlite3

import pytest

from scheduler.traces.capture import device_figures, step_figures, unattributed_figures
from scheduler.traces.gpu_time import gpu_times
from scheduler.traces.nsys import read_sqlite

MS = 1_000_000  # the export's times are nanoseconds


def capture(path, *, strings=(), nvtx=(), runtime=(), kernels=(), memcpys=(),
            memsets=None) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", strings)
    # Columns beyond those read, in another order than the reader's: read by name.
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType "
               "INTEGER NOT NULL, rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, "
               "globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER)")
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, "
                   "domainId) VALUES (?, ?, ?, ?, ?, ?, ?)", nvtx)
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, "
               "eventClass INTEGER, globalTid INTEGER, correlationId INTEGER, nameId INTEGER)")
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, globalTid, "
                   "correlationId) VALUES (?, ?, ?, ?)", runtime)
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId "
               "INTEGER, contextId INTEGER, streamId INTEGER, correlationId INTEGER, "
               "demangledName INTEGER, shortName INTEGER)")
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, streamId, "
                   "correlationId, shortName) VALUES (?, ?, ?, ?, ?, ?)", kernels)
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, deviceId "
               "INTEGER, streamId INTEGER, correlationId INTEGER, bytes INTEGER)")
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, streamId, "
                   "correlationId) VALUES (?, ?, ?, ?, ?)", memcpys)
    if memsets is not None:
        db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER, end INTEGER, "
                   "deviceId INTEGER, correlationId INTEGER)")
        db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?, ?, ?, ?)", memsets)
    db.commit()
    db.close()


OURS, OTHER = 1, 2
DOMAINS = [(0, None, 75, "overlap", None, None, OURS), (0, None, 75, None, None, 9, OTHER)]


def test_work_is_attributed_to_the_innermost_overlap_range_of_its_launching_thread(tmp_path):
    f = tmp_path / "cap.sqlite"
    capture(
        f,
        strings=[(5, "reshard s0→s1 mb0 #0 on device 4"), (9, "some.other.library"),
                 (20, "gemm_kernel"), (21, "ncclDevKernel_AllReduce"), (22, "elementwise")],
        nvtx=[*DOMAINS,
              # thread 100: a compute op (start/end range, inline text)
              (0, 100 * MS, 60, "F s0 mb0 on device 4", 100, None, OURS),
              # thread 200: a transfer (push/pop, text by id), with another domain's range
              # inside it that must be ignored
              (0, 100 * MS, 59, None, 200, 5, OURS),
              (12 * MS, 20 * MS, 59, "F s9 mb9 on device 7", 200, None, OTHER),
              # thread 300: a compute range with a transfer range nested inside it
              (0, 1000 * MS, 60, "B s1 mb0 on device 6", 300, None, OURS),
              (100 * MS, 200 * MS, 60, "grad s1→s0 mb0 #0 on device 6", 300, None, OURS)],
        runtime=[(10 * MS, 11 * MS, 100, 1), (15 * MS, 16 * MS, 200, 2),
                 (150 * MS, 151 * MS, 300, 3), (300 * MS, 301 * MS, 300, 4),
                 (500 * MS, 501 * MS, 400, 5), (550 * MS, 551 * MS, 400, 6)],
        kernels=[(20 * MS, 60 * MS, 0, 7, 1, 20),     # compute, device 4 (from its range)
                 (150 * MS, 180 * MS, 0, 8, 3, 22),   # comm (innermost), device 6
                 (300 * MS, 400 * MS, 0, 7, 4, 20),   # compute, device 6
                 (500 * MS, 600 * MS, 1, 9, 5, 21),   # NCCL outside any range: comm, GPU 1
                 (550 * MS, 580 * MS, 1, 7, 6, 20)],  # outside any range: compute, GPU 1
        memcpys=[(40 * MS, 90 * MS, 0, 8, 2)])        # comm, device 4
    work = read_sqlite(f).work
    # Work outside every range is unattributed (None), kept with its GPU: never booked to a
    # device (GPU 1 may run several of the runtime's devices).
    assert sorted((w.device or -1, w.gpu, w.category, w.label) for w in work) == sorted([
        (4, 0, "compute", "F s0 mb0 on device 4"),
        (6, 0, "comm", "grad s1→s0 mb0 #0 on device 6"),
        (6, 0, "compute", "B s1 mb0 on device 6"),
        (-1, 1, "comm", "ncclDevKernel_AllReduce"),
        (-1, 1, "compute", "gemm_kernel"),
        (4, 0, "comm", "reshard s0→s1 mb0 #0 on device 4")])
    figures = {d: f.as_json() for d, f in device_figures(work).items()}
    assert sorted(figures) == [4, 6]
    assert figures[4] == pytest.approx({"compute_ms": 40.0, "comm_ms": 50.0,
                                        "exposed_comm_ms": 30.0, "overlap_pct": 40.0,
                                        "waited_for_transfer_ms": 0.0})
    assert figures[6] == pytest.approx({"compute_ms": 100.0, "comm_ms": 30.0,
                                        "exposed_comm_ms": 30.0, "overlap_pct": 0.0,
                                        "waited_for_transfer_ms": 0.0})
    assert unattributed_figures(work)[1].as_json() == pytest.approx({
        "compute_ms": 30.0, "comm_ms": 100.0, "exposed_comm_ms": 70.0, "overlap_pct": 30.0,
        "waited_for_transfer_ms": None})


def test_step_ranges_give_iteration_time_and_bubble(tmp_path, capsys):
    import json

    import overlap.cli

    f = tmp_path / "steps.sqlite"
    capture(
        f,
        strings=[(1, "gemm")],
        nvtx=[*DOMAINS,
              (0, 100 * MS, 60, "step 0", 1, None, OURS),
              (200 * MS, 300 * MS, 60, "step 1", 1, None, OURS),
              # another process (thread) of the same job ends step 0 later: one window
              (5 * MS, 110 * MS, 60, "step 0", 2, None, OURS),
              (0, 900 * MS, 60, "step 7", 1, None, OTHER),  # another domain's: ignored
              (0, 50 * MS, 60, "F s0 mb0 on device 4", 1, None, OURS),
              (200 * MS, 300 * MS, 60, "F s0 mb1 on device 4", 1, None, OURS),
              (20 * MS, 30 * MS, 60, "B s1 mb0 on device 6", 2, None, OURS)],
        runtime=[(1 * MS, 2 * MS, 1, 1), (201 * MS, 202 * MS, 1, 2), (21 * MS, 22 * MS, 2, 3),
                 (500 * MS, 501 * MS, 3, 4)],
        kernels=[(0, 50 * MS, 0, 7, 1, 1), (200 * MS, 300 * MS, 0, 7, 2, 1),
                 (20 * MS, 30 * MS, 1, 7, 3, 1),
                 (500 * MS, 600 * MS, 2, 7, 4, 1)])  # GPU 2 computes outside every step
    cap = read_sqlite(f)
    assert cap.steps == {0: (0.0, pytest.approx(0.11)), 1: (pytest.approx(0.2),
                                                            pytest.approx(0.3))}
    # Windows 110 + 100 ms; device 4 idle 60 ms of them, device 6 idle 200 ms; GPU 2 never
    # computed inside a step and does not count.
    want = {"steps": 2, "iteration_ms": 105.0, "bubble_pct": 100 * 260 / (210 * 2)}
    assert step_figures(cap) == pytest.approx(want)
    assert overlap.cli.main(["trace", "report", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {k: data[k] for k in want} == pytest.approx(want)
    assert set(data["devices"]) == {"4", "6"}  # GPU 2's work is in no range: unattributed
    assert [(u["rank"], u["gpu"]) for u in data["unattributed"]] == [(0, 2)]
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    assert "2 steps, iteration 105.000 ms (mean), bubble 61.9%" in capsys.readouterr().out


def test_a_capture_without_step_ranges_says_so(tmp_path, capsys):
    import overlap.cli

    f = tmp_path / "nosteps.sqlite"
    capture(f, strings=[(1, "gemm")], runtime=[(0, 1, 7, 1)], kernels=[(0, MS, 0, 7, 1, 1)])
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    assert "no step ranges in it" in capsys.readouterr().out


def test_a_capture_without_overlap_ranges_is_unattributed_per_gpu_by_kernel_names(tmp_path):
    f = tmp_path / "plain.sqlite"
    capture(f, strings=[(1, "ncclKernel_Broadcast"), (2, "gemm")],
            runtime=[(0, 1, 7, 1), (0, 1, 7, 2)],
            kernels=[(0, 10 * MS, 3, 1, 1, 1), (5 * MS, 20 * MS, 3, 2, 2, 2)],
            memsets=[(30 * MS, 31 * MS, 3, 99)])  # its launch is not in the capture
    work = read_sqlite(f).work
    assert device_figures(work) == {}
    # The memset is memory work: neither compute nor communication (as HTA classes it) ...
    figures = {g: f.as_json() for g, f in unattributed_figures(work).items()}
    assert figures == {3: pytest.approx({"compute_ms": 15.0, "comm_ms": 10.0,
                                         "exposed_comm_ms": 5.0, "overlap_pct": 50.0,
                                         "waited_for_transfer_ms": None})}
    # ... but the GPU's time: busy 21 ms of its 31, 15 of them computing.
    assert gpu_times(work)[3].as_json() == pytest.approx({
        "span_ms": 31.0, "idle_ms": 10.0, "compute_ms": 15.0, "non_compute_ms": 6.0})


def test_missing_tables_read_as_empty(tmp_path):
    f = tmp_path / "empty.sqlite"
    sqlite3.connect(f).execute("CREATE TABLE StringIds (id INTEGER, value TEXT)").connection.close()
    capture = read_sqlite(f)
    assert capture.work == () and capture.steps == {} and device_figures([]) == {}
    assert step_figures(capture) is None


def test_files_that_are_no_capture_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_sqlite(tmp_path / "missing.sqlite")
    (tmp_path / "trace.json").write_text("{}")
    with pytest.raises(ValueError, match="not an SQLite file"):
        read_sqlite(tmp_path / "trace.json")
    (tmp_path / "corrupt.sqlite").write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        read_sqlite(tmp_path / "corrupt.sqlite")


# ---- overlap trace report ----------------------------------------------------------------------


def test_trace_report_reads_an_nsight_export(tmp_path, capsys):
    import json

    import overlap.cli

    f = tmp_path / "plain.sqlite"
    capture(f, strings=[(1, "ncclKernel_Broadcast"), (2, "gemm")],
            runtime=[(0, 1, 7, 1), (0, 1, 7, 2)],
            kernels=[(0, 10 * MS, 3, 1, 1, 1), (5 * MS, 20 * MS, 3, 2, 2, 2)])
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    text = capsys.readouterr().out
    assert "unattributed" in text and "exposed ms" in text and "50.0%" in text
    assert overlap.cli.main(["trace", "report", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] == {}
    assert data["unattributed"] == [pytest.approx({
        "rank": 0, "gpu": 3, "compute_ms": 15.0, "comm_ms": 10.0, "exposed_comm_ms": 5.0,
        "overlap_pct": 50.0, "waited_for_transfer_ms": None})]


def test_trace_report_json_means_the_same_for_our_own_traces(tmp_path, capsys):
    import json

    import overlap.cli

    assert overlap.cli.main(["simulate", "--stages", "2", "--microbatches", "2", "--shape",
                             "64,64", "--trace-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    trace = sorted(tmp_path.glob("sim-*.json"))[0]
    assert overlap.cli.main(["trace", "report", str(trace), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] and data["iteration_ms"] > 0 and data["steps"] == 1
    assert 0 <= data["bubble_pct"] <= 100
    for figures in data["devices"].values():
        assert set(figures) == {"compute_ms", "comm_ms", "exposed_comm_ms", "overlap_pct",
                                "waited_for_transfer_ms", "stages", "rank"}
        assert 0 <= figures["waited_for_transfer_ms"] <= figures["exposed_comm_ms"] + 1e-9
        assert 0 <= figures["exposed_comm_ms"] <= figures["comm_ms"] + 1e-9


def test_trace_report_of_an_nsys_rep_says_how_to_export_it(tmp_path, capsys, monkeypatch):
    import overlap.cli

    monkeypatch.setenv("PATH", str(tmp_path / "no-nsys-here"))
    (tmp_path / "cap.nsys-rep").write_bytes(b"\0")
    assert overlap.cli.main(["trace", "report", str(tmp_path / "cap.nsys-rep")]) == 2
    assert "`nsys export --type sqlite" in capsys.readouterr().err


def _exporting_nsys(tmp_path, monkeypatch) -> None:
    """A stand-in ``nsys`` alone on PATH whose ``export`` writes the export a real one would
    (one kernel of 4 ms on device 2) to its ``--output``, never asked to overwrite."""
    import stat
    import sys

    source = tmp_path / "made.sqlite"
    capture(source, strings=[(1, "gemm")], runtime=[(0, 1, 7, 1)],
            kernels=[(0, 4 * MS, 2, 1, 1, 1)])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(f"#!{sys.executable}\nimport shutil, sys\n"
                    "args = sys.argv[1:]\nassert args[:3] == ['export', '--type', 'sqlite']\n"
                    "assert '--force-overwrite' not in args\n"
                    f"shutil.copy({str(source)!r}, args[args.index('--output') + 1])\n")
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_trace_report_exports_an_nsys_rep_with_nsys_when_on_path(tmp_path, capsys, monkeypatch):
    # A stand-in `nsys` that writes the export a real one would (its --output argument).
    import json

    import overlap.cli

    _exporting_nsys(tmp_path, monkeypatch)
    (tmp_path / "cap.nsys-rep").write_bytes(b"\0")
    assert overlap.cli.main(["trace", "report", str(tmp_path / "cap.nsys-rep"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["unattributed"][0]["gpu"] == 2
    assert data["unattributed"][0]["compute_ms"] == pytest.approx(4.0)


# ---- PyTorch profiler (Kineto) traces ------------------------------------------------------------

US = 1000  # Kineto times are microseconds: 1000 µs = 1 ms


def kineto(path, events) -> None:
    import json

    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 1, "cat": "cpu_op", "name": "aten::mm"},
        *events]}))


def test_a_pytorch_profiler_trace_is_attributed_like_an_nsight_capture(tmp_path, capsys):
    import json

    import overlap.cli
    from scheduler.traces.kineto import read_kineto

    def x(cat, name, ts, dur, pid=1, tid=10, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    f = tmp_path / "torch_trace.json"
    kineto(f, [
        x("user_annotation", "F s0 mb0 on device 4", 0, 100 * US, tid=10),
        x("user_annotation", "reshard s0→s1 mb0 #0 on device 4", 0, 100 * US, tid=20),
        x("user_annotation", "optimizer step", 10 * US, 5 * US, tid=20),  # not one of ours
        x("cuda_runtime", "cudaLaunchKernel", 10 * US, 1, tid=10, correlation=1),
        x("cuda_driver", "cuMemcpyAsync", 12 * US, 1, tid=20, correlation=2),
        x("kernel", "gemm", 20 * US, 40 * US, pid=0, tid=7, device=0, correlation=1),
        x("gpu_memcpy", "Memcpy DtoD", 40 * US, 50 * US, pid=0, tid=8, device=0,
          correlation=2),
        x("kernel", "ncclDevKernel_Broadcast", 500 * US, 100 * US, pid=1, tid=9, device=1,
          correlation=77),  # its launch is not in the trace: by name
    ])
    work = read_kineto(f).work
    assert sorted((w.device or -1, w.gpu, w.category) for w in work) == [
        (-1, 1, "comm"), (4, 0, "comm"), (4, 0, "compute")]
    assert overlap.cli.main(["trace", "report", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"]["4"].pop("stages") == [0]
    assert data["devices"]["4"] == pytest.approx({
        "compute_ms": 40.0, "comm_ms": 50.0, "exposed_comm_ms": 30.0, "overlap_pct": 40.0,
        "waited_for_transfer_ms": 0.0, "rank": 0})
    assert set(data["devices"]) == {"4"}
    assert data["unattributed"][0]["gpu"] == 1
    assert data["unattributed"][0]["exposed_comm_ms"] == pytest.approx(100.0)


def test_a_json_trace_of_neither_kind_is_named(tmp_path, capsys):
    import overlap.cli

    (tmp_path / "t.json").write_text('{"traceEvents": [{"ph": "X", "name": "x"}]}')
    assert overlap.cli.main(["trace", "report", str(tmp_path / "t.json")]) == 2
    assert "not a trace written by overlap" in capsys.readouterr().err


def test_trace_plot_draws_any_source(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the viz extra is not installed")
    import overlap.cli

    f = tmp_path / "cap.sqlite"
    capture(f, strings=[(1, "ncclKernel_Broadcast"), (2, "gemm")],
            runtime=[(0, 1, 7, 1), (0, 1, 7, 2)],
            kernels=[(0, 10 * MS, 3, 1, 1, 1), (5 * MS, 20 * MS, 4, 2, 2, 2)])
    png = tmp_path / "out" / "timeline.png"
    assert overlap.cli.main(["trace", "plot", str(f), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pytorch_step_ranges_runtime_ones_first_else_profiler_steps(tmp_path):
    from scheduler.traces.kineto import read_kineto

    def ann(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid,
                "ts": ts, "dur": dur, "args": {}}

    gpu = [{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0,
            "dur": 30 * US, "args": {"device": 0, "correlation": 5}}]
    f = tmp_path / "prof_steps.json"
    kineto(f, [ann("ProfilerStep#3", 0, 100 * US), ann("ProfilerStep#4", 100 * US, 50 * US),
               *gpu])
    cap = read_kineto(f)
    assert sorted(cap.steps) == [3, 4]
    assert step_figures(cap) == pytest.approx({"steps": 2, "iteration_ms": 75.0,
                                               "bubble_pct": 80.0})
    # With the runtime's own step ranges present, those are the steps.
    kineto(f, [ann("ProfilerStep#3", 0, 100 * US), ann("step 0", 10 * US, 40 * US, tid=2),
               *gpu])
    cap = read_kineto(f)
    assert cap.steps == {0: (pytest.approx(0.01), pytest.approx(0.05))}
    assert step_figures(cap)["bubble_pct"] == pytest.approx(50.0)


# ---- overlap profile ---------------------------------------------------------------------------


def _fake_nsys(tmp_path, source, *, write=True):
    """A stand-in ``nsys`` on PATH: records its arguments and environment, runs the profiled
    command (after nsys's own options) and writes ``source`` as the SQLite export."""
    import stat
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(
        f"#!{sys.executable}\nimport json, os, shutil, subprocess, sys\n"
        "args = sys.argv[1:]\n"
        f"json.dump({{'args': args, 'env': os.environ.get('OVERLAP_PROFILE_STEPS')}}, "
        f"open({str(tmp_path / 'nsys_call.json')!r}, 'w'))\n"
        "out = [a for a in args if a.startswith('--output=')][0].split('=', 1)[1]\n"
        "command = [a for a in args[1:] if not a.startswith('--')]\n"
        "rc = subprocess.run(command).returncode\n"
        + (f"shutil.copy({str(source)!r}, out + '.sqlite')\n" if write else "")
        + "sys.exit(rc)\n")
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_overlap_profile_runs_the_script_under_nsys_with_a_capture_window(tmp_path, capsys,
                                                                         monkeypatch):
    import json
    import os
    import sys

    import overlap.cli

    source = tmp_path / "made.sqlite"
    capture(source, strings=[(1, "ncclKernel_Broadcast"), (2, "gemm")],
            runtime=[(0, 1, 7, 1), (0, 1, 7, 2)],
            kernels=[(0, 10 * MS, 3, 1, 1, 1), (5 * MS, 20 * MS, 3, 2, 2, 2)])
    bin_dir = _fake_nsys(tmp_path, source)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # The profiled script: a Runtime that reads its window from the environment.
    script = tmp_path / "train.py"
    script.write_text("import overlap\nfrom scheduler import Cluster\n"
                      "rt = overlap.Runtime(Cluster.preset('p3.8xlarge', 1))\n"
                      f"open({str(tmp_path / 'window.txt')!r}, 'w')"
                      ".write(repr(rt.profile_steps))\nrt.close()\n")
    out = tmp_path / "prof"
    assert overlap.cli.main(["profile", "--steps", "3:5", "-o", str(out), "--json", "--",
                             sys.executable, str(script)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["unattributed"][0]["exposed_comm_ms"] == pytest.approx(5.0)
    call = json.loads((tmp_path / "nsys_call.json").read_text())
    assert call["args"][0] == "profile" and call["env"] == "3:5"
    for flag in ("--trace=cuda,nvtx", "--export=sqlite", "--capture-range=cudaProfilerApi",
                 "--capture-range-end=stop", f"--output={out / 'profile'}"):
        assert flag in call["args"]
    assert call["args"][-2:] == [sys.executable, str(script)]
    assert (tmp_path / "window.txt").read_text() == "range(3, 5)"
    # Without --steps: the whole run, no capture range, no window.
    assert overlap.cli.main(["profile", "-o", str(out), "--", sys.executable, str(script)]) == 0
    assert "exposed ms" in capsys.readouterr().out
    call = json.loads((tmp_path / "nsys_call.json").read_text())
    assert call["env"] is None and not any("capture-range" in a for a in call["args"])
    assert (tmp_path / "window.txt").read_text() == "None"


def test_overlap_profile_without_nsys_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    import overlap.cli

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert overlap.cli.main(["profile", "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "`nsys` is not on PATH" in err and "nsight-systems" in err


@pytest.mark.parametrize("argv, match", [
    (["--steps", "5:3", "--", "python", "t.py"], "--steps: expected consecutive steps"),
    (["--steps", "x", "--", "python", "t.py"], "--steps: expected 'A:B'"),
    ([], "command: give the program to profile after --"),
])
def test_overlap_profile_refuses_bad_arguments(argv, match, capsys):
    import overlap.cli

    with pytest.raises(SystemExit) as exit_:
        overlap.cli.main(["profile", *argv])
    assert exit_.value.code == 2 and match in capsys.readouterr().err


def test_overlap_profile_when_nsys_writes_nothing(tmp_path, capsys, monkeypatch):
    import os
    import sys

    import overlap.cli

    bin_dir = _fake_nsys(tmp_path, None, write=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rc = overlap.cli.main(["profile", "-o", str(tmp_path / "p"), "--", sys.executable, "-c",
                           "raise SystemExit(3)"])
    assert rc == 3 and "nsys wrote no" in capsys.readouterr().err


def test_trace_report_never_replaces_a_file_the_user_did_not_name(tmp_path, capsys,
                                                                  monkeypatch):
    # cap.sqlite exists and is older than cap.nsys-rep: the export goes elsewhere.
    import json
    import os
    import time

    import overlap.cli

    _exporting_nsys(tmp_path, monkeypatch)
    mine = tmp_path / "cap.sqlite"
    mine.write_bytes(b"the user's own file")
    past = time.time() - 100
    os.utime(mine, (past, past))
    (tmp_path / "cap.nsys-rep").write_bytes(b"\0")
    assert overlap.cli.main(["trace", "report", str(tmp_path / "cap.nsys-rep"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unattributed"][0]["compute_ms"] == \
        pytest.approx(4.0)
    assert mine.read_bytes() == b"the user's own file"
