"""``overlap trace report``: one definition of exposed communication for every source, one
per-device table, unattributed GPU work kept apart, CPU-only PyTorch profiler traces, and
several files (one per rank) merged into one report."""

from __future__ import annotations

import json
import re

import pytest
from cli_errors import assert_one_line_error, run_overlap
from hypothesis import given, settings
from hypothesis import strategies as st
from test_nsys import DOMAINS, MS, OURS, capture

import overlap.cli
from scheduler import Timeline
from scheduler.exposure import DEFINITION, figures_of, waited_by_name
from scheduler.traces.capture import GpuWork, device_figures, unattributed_figures
from scheduler.traces.nsys import read_sqlite


def _simulated(tmp_path, *extra: str) -> Timeline:
    assert overlap.cli.main(["simulate", "--stages", "3", "--gpus-per-stage", "1",
                             "--microbatches", "4", "--shape", "256,1024",
                             "--trace-dir", str(tmp_path), *extra]) == 0
    return Timeline.from_chrome_trace(tmp_path / "sim-1f1b.json")


def _report_json(capsys, *files) -> dict:
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", *map(str, files), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_consistent(f: dict) -> None:
    """The columns agree with each other (the definitions' order and overlap %)."""
    assert 0 <= f["exposed_comm_ms"] <= f["comm_ms"] * (1 + 1e-9) + 1e-9
    if f["waited_for_transfer_ms"] is not None:
        assert 0 <= f["waited_for_transfer_ms"] <= f["exposed_comm_ms"] * (1 + 1e-9) + 1e-9
    if f["comm_ms"] > 0:
        assert f["overlap_pct"] == pytest.approx(100 * (1 - f["exposed_comm_ms"] / f["comm_ms"]))
    else:
        assert f["overlap_pct"] is None


# ---- one definition, one table -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["compute", "comm"]), st.integers(0, 50),
                          st.integers(0, 20)), max_size=25))
def test_figures_agree_with_each_other_whatever_the_intervals(items):
    compute = [(a, a + d) for c, a, d in items if c == "compute"]
    comm = [(a, a + d) for c, a, d in items if c == "comm"]
    f = figures_of(compute, comm)
    # Brute force on a 1/2-unit grid: comm time not under any compute.
    grid = [k / 2 + 0.25 for k in range(2 * 80)]
    inside = lambda t, ivs: any(a < t < b for a, b in ivs)
    assert f.exposed == pytest.approx(sum(0.5 for t in grid if inside(t, comm)
                                          and not inside(t, compute)))
    assert f.comm == pytest.approx(sum(0.5 for t in grid if inside(t, comm)))
    assert 0 <= f.exposed <= f.comm
    _check_consistent(f.as_json())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["F", "B", "reshard", "grad"]), st.integers(0, 2),
                          st.integers(0, 40), st.integers(1, 10)), max_size=20))
def test_waits_found_by_name_are_part_of_the_exposed_time(ops):
    # A compute stream runs one op at a time: computes are laid end to end in start order.
    work, t = [], 0.0
    for kind, mb, start, dur in ops:
        if kind in "FB":
            t = max(t, start)
            work.append(("compute", f"{kind} s1 mb{mb} on device 3", t, t + dur))
            t += dur
        else:
            src, dst = (0, 1) if kind == "reshard" else (2, 1)
            work.append(("comm", f"{kind} s{src}->s{dst} mb{mb} #0 on device 3", start,
                         start + dur))
    waited = waited_by_name(work)
    f = figures_of([(a, b) for c, _, a, b in work if c == "compute"],
                   [(a, b) for c, _, a, b in work if c == "comm"], waited)
    assert 0 <= f.waited <= f.exposed + 1e-9 <= f.comm + 2e-9


def test_waits_count_only_a_computes_own_inputs_while_it_was_idle():
    work = [("comm", "reshard s0->s1 mb0 #0 on device 3", 0.0, 4.0),   # F s1 mb0's input
            ("comm", "grad s2->s1 mb5 #0 on device 3", 0.0, 4.0),      # not an input of it
            ("compute", "F s1 mb0 on device 3", 3.0, 5.0),             # idle 0..3, input 0..4
            ("comm", "grad s2->s1 mb0 #0 on device 3", 4.0, 9.0),
            ("compute", "B s1 mb0 on device 3", 8.0, 10.0)]            # idle 5..8 under it
    assert waited_by_name(work) == pytest.approx(3.0 + 3.0)


def test_a_report_has_one_table_whose_columns_agree(tmp_path, capsys):
    tl = _simulated(tmp_path)
    path = tmp_path / "sim-1f1b.json"
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", str(path)]) == 0
    text = capsys.readouterr().out
    heads = [line for line in text.splitlines() if "exposed ms" in line]
    assert len(heads) == 1 and "waited for transfers ms" in heads[0]
    assert "hidden" not in heads[0]  # (one word for one thing: overlap %)
    data = _report_json(capsys, path)
    assert data["definition"] == DEFINITION
    for d, f in data["devices"].items():
        _check_consistent(f)
        assert f["exposed_comm_ms"] == pytest.approx(tl.exposed_comm(int(d)) * 1e3)
        assert f["waited_for_transfer_ms"] == pytest.approx(tl.transfer_wait(int(d)) * 1e3)
    assert Timeline.report(tl).count("exposed ms") == 1


def test_help_states_the_definition():
    done = run_overlap("trace", "--help")
    assert done.returncode == 0
    assert " ".join(DEFINITION.split()) in " ".join(done.stdout.split())


# ---- unattributed GPU work -----------------------------------------------------------------------


def test_work_outside_every_range_is_unattributed_not_booked_to_a_device(tmp_path, capsys):
    # Devices 0 and 1 are two virtual devices on GPU 0; an NCCL kernel ran there inside none
    # of the runtime's ranges: nobody can tell whose it was.
    f = tmp_path / "shared_gpu.sqlite"
    capture(f, strings=[(1, "gemm"), (2, "ncclDevKernel_Broadcast")],
            nvtx=[*DOMAINS, (0, 10 * MS, 60, "F s0 mb0 on device 0", 1, None, OURS),
                  (20 * MS, 30 * MS, 60, "F s1 mb0 on device 1", 2, None, OURS)],
            runtime=[(1 * MS, 2 * MS, 1, 1), (21 * MS, 22 * MS, 2, 2), (40 * MS, 41 * MS, 3, 3)],
            kernels=[(2 * MS, 8 * MS, 0, 7, 1, 1), (22 * MS, 28 * MS, 0, 7, 2, 1),
                     (5 * MS, 25 * MS, 0, 9, 3, 2)])
    work = read_sqlite(f).work
    figures = device_figures(work)
    assert sorted(figures) == [0, 1] and all(x.comm == 0 for x in figures.values())
    assert unattributed_figures(work)[0].comm == pytest.approx(0.020)
    data = _report_json(capsys, f)
    assert set(data["devices"]) == {"0", "1"}
    (u,) = data["unattributed"]
    assert (u["gpu"], u["comm_ms"], u["waited_for_transfer_ms"]) == (0, pytest.approx(20.0), None)
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^unattributed .*counted on no device", text, re.M)


def test_unattributed_work_keeps_its_gpu():
    work = [GpuWork(None, 0.0, 1.0, "comm", "nccl", gpu=3), GpuWork(4, 0.0, 1.0, "compute",
                                                                    "F s0 mb0 on device 4", 0)]
    assert list(unattributed_figures(work)) == [3] and list(device_figures(work)) == [4]


def test_a_profiler_trace_without_work_says_what_to_record(tmp_path, capsys):
    from test_nsys import kineto

    f = tmp_path / "empty.json"
    kineto(f, [])  # CPU ops only: no GPU work, none of the runtime's ranges
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    text = capsys.readouterr().out
    assert "no work in it" in text and "overlap.torch.profiler()" in text
    assert "exposed ms" not in text


# ---- several files: one per rank ---------------------------------------------------------------


def _split(tl: Timeline, groups, tmp_path) -> list:
    """One trace per rank, as each process of a job writes its own devices'."""
    out = []
    for k, devices in enumerate(groups):
        part = Timeline(tuple(s for s in tl.spans if s.device in devices), tl.num_stages,
                        tuple(devices), {d: tl.stage_of[d] for d in devices}, tl.inputs)
        out.append(part.to_chrome_trace(tmp_path / f"r{k}.json"))
    return out


def test_one_file_per_rank_is_merged_with_a_per_rank_breakdown(tmp_path, capsys):
    tl = _simulated(tmp_path)
    files = _split(tl, [(0,), (4,), (8,)], tmp_path)
    whole = _report_json(capsys, tmp_path / "sim-1f1b.json")
    data = _report_json(capsys, *files)
    assert set(data["devices"]) == set(whole["devices"]) == {"0", "4", "8"}
    for d, f in data["devices"].items():
        want = {**whole["devices"][d], "rank": [0, 4, 8].index(int(d))}
        assert f.pop("stages") == want.pop("stages")
        assert f == pytest.approx(want)
    assert [(r["rank"], r["file"], r["devices"]) for r in data["ranks"]] == [
        (k, str(p), [d]) for k, (p, d) in enumerate(zip(files, (0, 4, 8)))]
    assert data["iteration_ms"] == pytest.approx(max(r["iteration_ms"] for r in data["ranks"]))
    assert data["steps"] == 1
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", *map(str, files)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("3 files, one per rank:")
    assert all(f"rank {k}: {p}" in text for k, p in enumerate(files))
    assert sum("exposed ms" in line for line in text.splitlines()) == 1
    assert re.search(r"^rank\s+device\s+stage\s+compute ms", text, re.M)


def test_a_device_in_two_rank_files_is_refused(tmp_path):
    _simulated(tmp_path)
    trace = tmp_path / "sim-1f1b.json"
    assert_one_line_error(run_overlap("trace", "report", str(trace), str(trace)),
                          r"^error: file: device 0 is in both .* one file per rank")


def test_a_missing_file_among_several_is_named_before_any_is_read(tmp_path):
    _simulated(tmp_path)
    assert_one_line_error(run_overlap("trace", "report", str(tmp_path / "sim-1f1b.json"),
                                      str(tmp_path / "r9.json")),
                          r"^error: file: no such file: .*r9\.json$")


# ---- the rank each PyTorch trace names -----------------------------------------------------------


def _rank_trace(path, device: int, rank: object = None):
    """A PyTorch trace of one process: one compute op on ``device`` (the CPU backend's: its
    range is the work), naming ``rank`` in ``distributedInfo`` unless it is None."""
    data: dict = {"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": f"F s{device} mb0 on device {device}",
         "pid": 1, "tid": 1, "ts": 0, "dur": 10 + device, "args": {}}]}
    if rank is not None:
        data["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 8}
    path.write_text(json.dumps(data))
    return path


def test_traces_are_ordered_by_the_rank_each_names(tmp_path, capsys):
    from scheduler.traces.plot import traces_rows
    from scheduler.traces.report import in_rank_order, read_trace

    files = [_rank_trace(tmp_path / "a.json", 3, rank=3),
             _rank_trace(tmp_path / "b.json", 1, rank=1)]
    data = _report_json(capsys, *files)
    assert [(r["rank"], r["file"]) for r in data["ranks"]] == [(1, str(files[1])),
                                                             (3, str(files[0]))]
    assert {d: f["rank"] for d, f in data["devices"].items()} == {"1": 1, "3": 3}
    assert overlap.cli.main(["trace", "report", *map(str, files)]) == 0
    text = capsys.readouterr().out
    assert text.index(f"rank 1: {files[1]}") < text.index(f"rank 3: {files[0]}")
    ranked = in_rank_order([read_trace(f) for f in files])
    rows = traces_rows([t for _, t in ranked], [k for k, _ in ranked])
    assert [r.name for r in rows] == ["r1 d1 compute", "r3 d3 compute"]


def test_without_a_rank_in_every_trace_the_files_order_is_the_ranks(tmp_path, capsys):
    files = [_rank_trace(tmp_path / "a.json", 3, rank=3), _rank_trace(tmp_path / "b.json", 1)]
    data = _report_json(capsys, *files)
    assert [(r["rank"], r["file"]) for r in data["ranks"]] == [(0, str(files[0])),
                                                             (1, str(files[1]))]


def test_two_traces_naming_one_rank_are_refused(tmp_path):
    a = _rank_trace(tmp_path / "a.json", 0, rank=2)
    b = _rank_trace(tmp_path / "b.json", 1, rank=2)
    assert_one_line_error(run_overlap("trace", "report", str(a), str(b)),
                          r"^error: file: .*a\.json and .*b\.json are both rank 2")


@pytest.mark.parametrize("rank", ["1", -1, 1.5, True])
def test_a_rank_that_is_no_rank_is_named(tmp_path, rank):
    f = _rank_trace(tmp_path / "a.json", 0, rank=rank)
    assert_one_line_error(run_overlap("trace", "report", str(f)),
                          r"^error: file: .*a\.json: its distributedInfo\.rank is .*, not a "
                          r"rank")


# ---- PyTorch profiler traces without GPU work (the CPU backend's) --------------------------------


def test_a_cpu_only_pytorch_profiler_trace_is_read_from_the_runtimes_ranges(tmp_path, capsys):
    torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    from torch import nn

    from overlap import Runtime
    from overlap.torch import TorchPipeline, profiler, replicate
    from scheduler import Cluster

    cluster = Cluster.preset("p3.8xlarge", 2)
    meshes = (cluster.mesh([0], gpus=1), cluster.mesh([1], gpus=1))
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4)]
    pipe = TorchPipeline([replicate(m, 1) for m in stages], meshes, nn.functional.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with Runtime(cluster, timeout=30) as rt:
        with profiler() as prof:
            pipe.train_step_sync(rt, x, y, num_microbatches=2)
        tl = rt.timeline()
    path = tmp_path / "torch.json"
    prof.export_chrome_trace(str(path))
    data = _report_json(capsys, path)
    assert set(data["devices"]) == {str(d) for d in tl.devices} == {"0", "4"}
    assert data["steps"] == 1 and data["iteration_ms"] > 0 and data["unattributed"] == []
    assert data["ranks"][0]["source"] == "kineto"
    for d, f in data["devices"].items():
        _check_consistent(f)
        assert f["compute_ms"] > 0 and f["comm_ms"] > 0
        assert f["stages"] == [tl.stage_of[int(d)]]
    # Every op of the step is read as one op: as many computes per device as the runtime ran.
    from scheduler.traces.report import read_trace

    work = read_trace(path).capture.work
    for d in tl.devices:
        ran = sorted(s.name for s in tl.spans_of(d) if s.stream == "compute")
        read = sorted(w.label.removesuffix(f" on device {d}") for w in work
                      if w.device == d and w.category == "compute")
        assert read == ran
