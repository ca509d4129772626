"""``overlap trace report`` agrees with Holistic Trace Analysis (HTA, Meta's
``HolisticTraceAnalysis`` 0.5.0: the ``hta`` extra) on random PyTorch profiler traces.

Each example writes one Kineto trace per rank (1 or 2 ranks, in a shuffled file order, each
naming its rank in ``distributedInfo.rank``): GPU work of every kind — compute kernels, NCCL
kernels, memcpy, memset, synchronizations on a stream, kernels whose names HTA classes as
memory or other —, overlapping or not, on one or more CUDA streams of the rank's one GPU,
each launched by a ``cudaLaunchKernel`` with its correlation id, with or without
``ProfilerStep#N`` ranges (with them, HTA keeps only the work launched before the last step
starts: the launches all come before it, and a last, empty step closes the trace, as a
profiler's schedule leaves it). The report reads them with ``overlap trace report --json``,
HTA with ``TraceAnalysis``; per rank:

- HTA's ``get_temporal_breakdown``: ``kernel_time(us)``, ``idle_time(us)``,
  ``compute_time(us)``, ``non_compute_time(us)`` equal our ``gpus`` entry of that rank's GPU
  (``span_ms``, ``idle_ms``, ``compute_ms``, ``non_compute_ms``);
- HTA's ``get_comm_comp_overlap``: ``comp_comm_overlap_pctg`` — 100 × the time NCCL kernels
  ran together with compute kernels / the time NCCL kernels ran, rounded to 0.01 — equals our
  ``overlap_pct`` of that GPU's (unattributed) work, 100 × (1 − exposed / comm): our exposed
  communication is communication time during which no compute ran, so ``comm - exposed`` is
  exactly HTA's overlapping time. Without communication HTA's is NaN and ours is null (or the
  GPU has no compute or communication to report);
- the ranks are the same: ours ordered by ``distributedInfo.rank`` as HTA's.

Within 1 ns (ours are seconds as floats, HTA's integer microseconds) and HTA's rounding.

Not generated — deliberate differences: a ``Stream Wait Event`` synchronization, which HTA's
name rules class as computation (its name has no "Sync") and ours, by what it is, as other
work; traces whose times are fractions of a microsecond, which HTA rounds inwards to whole
ones; several GPUs in one rank's trace (HTA adds them up as one).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import overlap.cli

hta_analysis = pytest.importorskip("hta.trace_analysis",
                                   reason="HolisticTraceAnalysis is not installed (the hta "
                                          "extra)")
logging.getLogger("hta").setLevel(logging.ERROR)  # (it logs every file it parses)
# HTA's own warnings (pandas deprecations; its NaN overlap without communication) are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::Warning:hta.*")

# (category, name pool, stream) per kind of work; stream None: any of STREAMS.
KINDS = {
    "compute": ("kernel", ["ampere_sgemm_128x64_nn", "triton_poi_fused_add_0",
                           "void at::native::vectorized_elementwise_kernel<4>",
                           "nccl_reduce_helper", "memcpy_kernel"], None),
    "nccl": ("kernel", ["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclKernel_SendRecv"],
             None),
    "memcpy": ("gpu_memcpy", ["Memcpy DtoD (Device -> Device)",
                              "Memcpy HtoD (Pageable -> Device)"], None),
    "memset": ("gpu_memset", ["Memset (Device)"], None),
    "sync": ("cuda_sync", ["Stream Sync"], None),
    "named": ("kernel", ["dmaCopyKernel", "cub::DeviceSync_kernel", "void MemcpyLikeKernel"],
              None),
    # the host's waits (no stream): neither reads them as GPU work
    "host sync": ("cuda_sync", ["Context Sync", "Event Sync"], -1),
}
STREAMS = [7, 13, 20, 24]
# Every time starts 1 s in: HTA stores a trace's times in the smallest integer type that holds
# them, and sums of times below 128 µs would overflow its int8 (a real trace's times are
# microseconds since 1970).
T0 = 1_000_000


@st.composite
def gpu_event(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(KINDS)))
    cat, names, stream = KINDS[kind]
    return {"cat": cat, "name": draw(st.sampled_from(names)),
            "stream": stream if stream is not None else draw(st.sampled_from(STREAMS)),
            "ts": draw(st.integers(0, 400)), "dur": draw(st.integers(0, 120))}


def on_a_stream(events: list[dict]) -> bool:
    return any(e["stream"] >= 0 for e in events)


@st.composite
def job(draw: st.DrawFn) -> tuple[list[list[dict]], list[int], int, list[int]]:
    """Per rank its GPU events; each rank's GPU; the ProfilerStep ranges before the last
    (0: none at all); the file order (a permutation of the ranks)."""
    ranks = draw(st.integers(1, 2))
    events = [draw(st.lists(gpu_event(), min_size=1, max_size=14).filter(on_a_stream))
              for _ in range(ranks)]
    gpus = [draw(st.integers(0, 7)) for _ in range(ranks)]
    return events, gpus, draw(st.integers(0, 3)), draw(st.permutations(range(ranks)))


def kineto_trace(rank: int, world: int, gpu: int, events: list[dict], steps: int) -> dict:
    """One rank's trace as PyTorch's profiler writes it: ``distributedInfo`` first (HTA
    finds the rank by the first ``"rank": N`` in the file), each GPU event launched from
    thread 10 (halfway to its start: before it, and before the last step)."""
    trace = []
    for k, e in enumerate(events, start=1):
        trace.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                      "tid": 10, "ts": T0 + e["ts"] // 2, "dur": 1,
                      "args": {"correlation": k}})
        trace.append({"ph": "X", "cat": e["cat"], "name": e["name"], "pid": gpu,
                      "tid": e["stream"], "ts": T0 + e["ts"], "dur": e["dur"],
                      "args": {"device": gpu, "stream": e["stream"], "correlation": k}})
    if steps:
        end = max(e["ts"] // 2 for e in events) + 2  # (after every launch)
        bounds = [end * j // steps for j in range(steps + 1)]
        for j in range(steps):
            trace.append(_step(j, T0 + bounds[j], bounds[j + 1] - bounds[j]))
        trace.append(_step(steps, T0 + end, 5))  # the last step: nothing launched in it
    return {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "schemaVersion": 1, "traceEvents": trace}


def _step(n: int, ts: int, dur: int) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1,
            "tid": 10, "ts": ts, "dur": dur, "args": {}}


# Our ``gpus`` keys (ms, less the suffix) -> HTA's temporal breakdown's columns (µs).
HTA_BREAKDOWN = {"span": "kernel_time(us)", "idle": "idle_time(us)",
                 "compute": "compute_time(us)", "non_compute": "non_compute_time(us)"}


def ours(paths: list[Path]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert overlap.cli.main(["trace", "report", *map(str, paths), "--json"]) == 0
    return json.loads(out.getvalue())


def theirs(paths: list[Path], folder: Path) -> tuple[dict[int, dict], dict[int, float]]:
    analysis = hta_analysis.TraceAnalysis(trace_files=[str(p) for p in paths],
                                          trace_dir=str(folder))
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    overlap_pct = analysis.get_comm_comp_overlap(visualize=False)
    return ({int(r["rank"]): r for r in breakdown.to_dict("records")},
            {int(r["rank"]): float(r["comp_comm_overlap_pctg"])
             for r in overlap_pct.to_dict("records")})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job())
def test_our_figures_equal_htas(case):
    events, gpus, steps, order = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = []
        for rank in order:
            path = folder / f"trace-{len(paths)}.json"
            path.write_text(json.dumps(kineto_trace(rank, len(order), gpus[rank],
                                                    events[rank], steps)))
            paths.append(path)
        report = ours(paths)
        breakdown, overlap_pct = theirs(paths, folder)
    assert [r["rank"] for r in report["ranks"]] == sorted(breakdown) == list(range(len(order)))
    for rank, want in breakdown.items():
        (got,) = [g for g in report["gpus"] if g["rank"] == rank]
        assert got["gpu"] == gpus[rank]
        assert {key: got[f"{key}_ms"] * 1e3 for key in HTA_BREAKDOWN} == pytest.approx(
            {key: float(want[column]) for key, column in HTA_BREAKDOWN.items()}, abs=1e-3)
        mine = [u for u in report["unattributed"] if u["rank"] == rank]
        if math.isnan(overlap_pct[rank]):
            assert all(u["overlap_pct"] is None for u in mine)
        else:
            (u,) = mine
            assert u["overlap_pct"] == pytest.approx(overlap_pct[rank], abs=0.005 + 1e-9)
