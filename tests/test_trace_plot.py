"""``overlap trace plot``: a row per device stream (compute, each comm channel and lane), each
op its own bar, labels and a legend, waits marked, several files in one picture, and ``-o``
naming exactly the file written (or one ``error:`` line)."""

from __future__ import annotations

import json

import pytest
from cli_errors import assert_one_line_error, run_overlap
from test_nsys import US, kineto

import overlap.cli
from scheduler import Timeline
from scheduler.traces.plot import capture_rows, figure, timeline_rows, traces_rows
from scheduler.traces.report import read_trace

pytest.importorskip("matplotlib", reason="the viz extra is not installed")


@pytest.fixture(scope="module")
def lanes(tmp_path_factory) -> Timeline:
    """The simulated eager-1f1b step of the example case: 4-GPU stages, transfers on lanes."""
    out = tmp_path_factory.mktemp("sim")
    assert overlap.cli.main(["simulate", "--case", "examples/cases/simulate_case.json",
                             "--trace-dir", str(out)]) == 0
    return Timeline.from_chrome_trace(out / "sim-eager-1f1b.json")


def test_each_stream_of_each_device_has_its_own_row(lanes):
    rows = timeline_rows(lanes)
    names = [r.name for r in rows]
    want = {f"d{d} {s}" for d in lanes.devices for s in lanes.streams(d)}
    assert len(names) == len(set(names)) and set(names) == want
    assert any(n.endswith(".1") for n in names)  # lanes above 0 are rows of their own
    d = lanes.devices[len(lanes.devices) // 2]  # a middle stage: channels both ways
    mine = [n.split(" ", 1)[1] for n in names if n.startswith(f"d{d} ")]
    assert mine[0] == "compute" and {"fwd", "bwd"} <= {m[:3] for m in mine[1:]}
    firsts = [m[:3] for m in mine[1:]]
    assert firsts == sorted(firsts, key=["fwd", "bwd"].index)  # activations, then gradients
    # Every span is one bar on its own stream's row: back-to-back ops are never merged.
    by_name = {r.name: r for r in rows}
    for dev in lanes.devices:
        for stream in lanes.streams(dev):
            spans = [s for s in lanes.spans_of(dev) if s.stream == stream]
            bars = by_name[f"d{dev} {stream}"].bars
            assert [(b.start, b.end) for b in bars] == [(s.start, s.end) for s in spans]


def test_bars_are_labelled_edged_and_explained_by_a_legend(tmp_path):
    assert overlap.cli.main(["simulate", "--stages", "4", "--gpus-per-stage", "1",
                             "--microbatches", "8", "--shape", "1024,8192",
                             "--trace-dir", str(tmp_path)]) == 0
    tl = Timeline.from_chrome_trace(tmp_path / "sim-1f1b.json")
    rows = timeline_rows(tl)
    fig = figure(rows, "t")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == [r.name for r in rows]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["F (forward)", "B (backward)", "activation transfer",
                      "gradient transfer", "compute waiting for a transfer"]
    labels = {t.get_text() for t in ax.texts}
    assert {f"F{m}" for m in range(8)} <= labels and {f"B{m}" for m in range(8)} <= labels
    bars = ax.collections[0]  # the first row's ops: edged apart
    assert len(bars.get_paths()) == len(rows[0].bars) and bars.get_linewidths()[0] > 0
    assert any(r.waits for r in rows)  # 1f1b's compute waits for transfers: marked
    compute = next(r for r in rows if r.name == "d4 compute")
    assert sum(b - a for a, b in compute.waits) == pytest.approx(tl.transfer_wait(4))
    fig.clf()


def test_a_cpu_only_profiler_trace_draws_one_row_per_channel(tmp_path):
    def ann(name, ts, dur, tid):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid,
                "ts": ts, "dur": dur, "args": {}}

    f = tmp_path / "torch.json"
    kineto(f, [ann("F s0 mb0 on device 0", 0, 10 * US, 1),
               ann("F s0 mb1 on device 0", 10 * US, 10 * US, 1),  # back to back
               ann("reshard s0->s1 mb0 #0 on device 0", 10 * US, 5 * US, 2),
               ann("grad s1->s0 mb0 #0 on device 0", 40 * US, 5 * US, 3),
               ann("B s0 mb0 on device 0", 50 * US, 20 * US, 1),
               ann("F s1 mb0 on device 4", 20 * US, 10 * US, 4)])
    rows = capture_rows(read_trace(f).capture.work)
    assert [r.name for r in rows] == ["d0 compute", "d0 fwd0", "d0 bwd0", "d4 compute"]
    assert [b.label for b in rows[0].bars] == ["F0", "F1", "B0"]
    # B s0 mb0 (from 50 ms, idle since 20 ms) waited while its gradient moved, 40 to 45 ms.
    assert rows[0].waits == (pytest.approx((0.040, 0.045)),)


def test_unattributed_work_has_a_row_per_class(tmp_path):
    def gpu(cat, name, ts, stream=7):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts,
                "dur": 5 * US, "args": {"device": 2, "stream": stream, "correlation": ts}}

    f = tmp_path / "torch.json"
    kineto(f, [gpu("kernel", "gemm", 0), gpu("kernel", "ncclKernel_Broadcast", 0, stream=9),
               gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10 * US),
               gpu("cuda_sync", "Stream Sync", 20 * US)])
    rows = capture_rows(read_trace(f).capture.work)
    assert [(r.name, [b.kind for b in r.bars]) for r in rows] == [
        ("GPU 2 unattributed compute", ["compute"]), ("GPU 2 unattributed comm", ["other"]),
        ("GPU 2 unattributed memory", ["memory"]), ("GPU 2 unattributed other", ["sync"])]


def test_several_files_are_drawn_one_under_the_other(tmp_path):
    assert overlap.cli.main(["simulate", "--stages", "2", "--gpus-per-stage", "1",
                             "--microbatches", "2", "--shape", "64,64",
                             "--trace-dir", str(tmp_path)]) == 0
    files = [tmp_path / "sim-1f1b.json", tmp_path / "sim-eager-1f1b.json"]
    rows = traces_rows([read_trace(p) for p in files])
    one = [r.name for r in timeline_rows(Timeline.from_chrome_trace(files[0]))]
    assert [r.name for r in rows] == [f"r{k} {n}" for k in (0, 1) for n in one]
    out = tmp_path / "both.png"
    done = run_overlap("trace", "plot", *map(str, files), "-o", str(out))
    assert done.returncode == 0 and done.stdout == f"wrote {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                           (".pdf", b"%PDF"), (".PNG", b"\x89PNG")])
def test_the_file_written_is_exactly_the_file_named(tmp_path, suffix, magic):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "F s0 mb0", "pid": 0, "tid": 0, "ts": 0, "dur": 10,
         "args": {"stage": 0, "microbatch": 0, "kind": "F", "op": 0}}]}))
    out = tmp_path / f"pic{suffix}"
    done = run_overlap("trace", "plot", str(trace), "-o", str(out))
    assert done.returncode == 0 and done.stdout == f"wrote {out}\n"
    assert out.read_bytes().startswith(magic)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"pic{suffix}", "t.json"])


@pytest.mark.parametrize("output, match", [
    ("out.txt", r"^error: -o: .*out\.txt has suffix '\.txt': name a \.png, \.svg or \.pdf"),
    ("out", r"^error: -o: .*out has no suffix: name a \.png, \.svg or \.pdf"),
    ("a_file/out.png", r"^error: -o: cannot write .*a_file/out\.png"),
    ("a_dir.png", r"^error: -o: cannot write .*a_dir\.png"),
])
def test_a_bad_output_is_one_error_line_and_nothing_is_written(tmp_path, output, match):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir.png").mkdir()
    before = sorted(tmp_path.rglob("*"))
    assert_one_line_error(run_overlap("trace", "plot", str(trace), "-o",
                                      str(tmp_path / output)), match)
    assert sorted(tmp_path.rglob("*")) == before


def test_timeline_plot_refuses_an_unknown_format(tmp_path, lanes):
    with pytest.raises(ValueError, match=r"^path: .*t\.jpeg has suffix '\.jpeg'"):
        lanes.plot(tmp_path / "t.jpeg")
    assert not (tmp_path / "t.jpeg").exists()
