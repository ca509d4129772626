"""GPU work classed as Holistic Trace Analysis (HTA) classes it — compute, communication,
memory, other — and each GPU's time split as HTA's temporal breakdown splits it, through
``overlap trace report``. (tests/test_hta_agreement.py compares both with HTA itself.)"""

from __future__ import annotations

import json

import pytest

import overlap.cli
from scheduler.traces.gpu_time import gpu_class

US = 1000  # Kineto times are microseconds: 1000 µs = 1 ms


@pytest.mark.parametrize(("name", "want"), [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "comm"),
    ("ncclKernel_SendRecv", "comm"),
    ("nccl_reduce_helper", "compute"),   # an NCCL name without "Kernel" after it
    ("my_ncclKernel", "compute"),        # "nccl" not at the start
    ("Memcpy DtoD (Device -> Device)", "memory"),
    ("Memset (Device)", "memory"),
    ("dmaCopyKernel", "memory"),
    ("void at::native::MemcpyLikeKernel<float>", "other"),  # "Memcpy" past the start
    ("cub::DeviceSync_kernel", "other"),
    ("memcpy_kernel", "compute"),        # the patterns are case-sensitive
    ("ampere_sgemm_128x64_nn", "compute"),
    ("gemm\nSync", "compute"),           # only the first line is looked at
    ("ncclDev\nKernel", "compute"),
])
def test_a_kernel_is_classed_by_its_name(name, want):
    assert gpu_class(name) == want


def test_memcpy_memset_and_sync_activities_are_classed_by_what_they_are():
    assert gpu_class("copy", "memcpy") == gpu_class("fill", "memset") == "memory"
    assert gpu_class("Stream Wait Event", "sync") == "other"
    with pytest.raises(ValueError, match="activity: expected one of kernel, memcpy"):
        gpu_class("gemm", "launch")


def _x(cat, name, ts, dur, pid=1, tid=10, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def _gpu(cat, name, ts, dur, correlation, stream=7, device=0):
    return _x(cat, name, ts, dur, pid=0, tid=stream, device=device, stream=stream,
              correlation=correlation)


def _report(tmp_path, capsys, events) -> dict:
    f = tmp_path / "trace.json"
    f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", str(f), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_unattributed_memory_and_sync_work_is_neither_compute_nor_communication(tmp_path,
                                                                                capsys):
    data = _report(tmp_path, capsys, [
        _gpu("kernel", "gemm", 0, 40 * US, 1),
        _gpu("kernel", "ncclDevKernel_AllReduce", 20 * US, 40 * US, 2, stream=9),
        _gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 60 * US, 20 * US, 3),
        _gpu("gpu_memset", "Memset (Device)", 80 * US, 5 * US, 4),
        _gpu("cuda_sync", "Stream Sync", 85 * US, 10 * US, 5),
        # a context's synchronization names no stream: the host's wait, not the GPU's work
        _gpu("cuda_sync", "Context Sync", 95 * US, 100 * US, 6, stream=-1)])
    assert data["devices"] == {}
    # The copies and the synchronization count as neither compute nor communication: the
    # all-reduce is half hidden under the GEMM.
    assert data["unattributed"] == [pytest.approx({
        "rank": 0, "gpu": 0, "compute_ms": 40.0, "comm_ms": 40.0, "exposed_comm_ms": 20.0,
        "overlap_pct": 50.0, "waited_for_transfer_ms": None})]
    # The GPU was busy from 0 to 95 ms: 40 computing, 55 not (the all-reduce's last 20, the
    # copies' 25, the stream synchronization's 10).
    assert data["gpus"] == [pytest.approx({"rank": 0, "gpu": 0, "span_ms": 95.0,
                                           "idle_ms": 0.0, "compute_ms": 40.0,
                                           "non_compute_ms": 55.0})]


def test_the_runtimes_ranges_still_class_its_copies_and_syncs_stay_apart(tmp_path, capsys):
    # The runtime's transfer on one GPU is a copy kernel launched in a "reshard" range: it is
    # the device's communication. A synchronization inside a range is no op's work.
    data = _report(tmp_path, capsys, [
        _x("user_annotation", "F s0 mb0 on device 4", 0, 100 * US, tid=10),
        _x("user_annotation", "reshard s0→s1 mb0 #0 on device 4", 0, 100 * US, tid=20),
        _x("cuda_runtime", "cudaLaunchKernel", 1 * US, 1, tid=10, correlation=1),
        _x("cuda_runtime", "cudaMemcpyAsync", 2 * US, 1, tid=20, correlation=2),
        _x("cuda_runtime", "cudaStreamSynchronize", 3 * US, 1, tid=20, correlation=3),
        _gpu("kernel", "gemm", 10 * US, 30 * US, 1),
        _gpu("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 30 * US, 20 * US, 2, stream=8),
        _gpu("cuda_sync", "Stream Sync", 50 * US, 10 * US, 3, stream=8)])
    device = data["devices"]["4"]
    assert (device["compute_ms"], device["comm_ms"], device["exposed_comm_ms"]) == \
        pytest.approx((30.0, 20.0, 10.0))
    assert data["unattributed"] == []  # (the synchronization is in no figure)
    # The GPU's own time classes the copy as memory and counts the synchronization: 50 ms
    # busy, 30 of them computing.
    assert data["gpus"] == [pytest.approx({"rank": 0, "gpu": 0, "span_ms": 50.0,
                                           "idle_ms": 0.0, "compute_ms": 30.0,
                                           "non_compute_ms": 20.0})]


def test_the_text_report_has_a_per_gpu_table(tmp_path, capsys):
    f = tmp_path / "trace.json"
    f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        _gpu("kernel", "gemm", 0, 10 * US, 1), _gpu("gpu_memset", "Memset (Device)",
                                                    30 * US, 10 * US, 2)]}))
    capsys.readouterr()
    assert overlap.cli.main(["trace", "report", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines.index("per GPU, all its work (kernels classed as Holistic Trace Analysis "
                       "classes them):")
    assert lines[head + 1].split() == ["GPU", "span", "ms", "idle", "ms", "compute", "ms",
                                       "non-compute", "ms"]
    assert lines[head + 2].split() == ["0", "40.000", "20.000", "10.000", "10.000"]
