"""The CUDA device kind's host logic, run on a numpy stand-in for CuPy (tests/fake_cupy.py).

Real GPUs run tests/test_cuda_backend.py (via benchmarks/gpu_check.py); this file runs
everywhere and checks that the kind's hooks on the backend's streams (a stream only waits on
events already recorded), its loopback collectives, NCCL groups and trace marks compute the
right results. What it observes it sees through the runtime's and the backend's public API,
the device-kind protocol (``CudaDevices``: ``waited``, ``joined``, ``device_wait``,
``waiters``, the transport's ``broadcast``) and the stand-in's own records (``fake_cupy``:
``launches``, ``waits``, ``nccl_calls``, ``concurrent_issue``, ``pool_releases``, ...).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import fake_cupy
import numpy as np
import pytest
from toy import ToyMLP, reference_step

from overlap import Runtime, StreamError
from overlap.backends import Backend, DeviceKind, Event, make_backend
from overlap.backends.devices.streams import current_stream
from overlap.errors import CollectiveAborted, DeviceFault, DeviceTimeout
from overlap.scope import CancelScope
from overlap.waits import OneShot, wait_on
from overlap.world import Placement
from scheduler import (
    SCHEDULES,
    STRATEGIES,
    Cluster,
    DeviceMesh,
    P,
    PlanOptions,
    Sharding,
    lower,
    make_schedule,
    plan_resharding,
)
from scheduler.regions import region_shape


def on_device(model: ToyMLP) -> ToyMLP:
    """The toy's weights as device arrays: CuPy refuses ``x @ w`` with a numpy ``w``."""
    model.weights = {k: fake_cupy.asarray(w) for k, w in model.weights.items()}
    return model


def on_host(model: ToyMLP) -> ToyMLP:
    model.weights = {k: fake_cupy.asnumpy(w) for k, w in model.weights.items()}
    model.grads = {k: fake_cupy.asnumpy(g) for k, g in model.grads.items()}
    return model


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake_cupy.nccl)
    fake_cupy.launches.clear()
    fake_cupy.nccl_calls.clear()
    fake_cupy.concurrent_issue.clear()


@pytest.fixture
def scope():
    """The scope of a test's work on a backend (a call's, at the backend level)."""
    s = CancelScope("test")
    yield s
    s.cancel(CollectiveAborted("test teardown"))  # a test that failed mid-collective ends


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reshard_through_the_cuda_backend(strategy):
    cluster = Cluster.preset("p3.8xlarge", 3)
    src = Sharding(cluster.mesh([0, 1]), P("host", "gpu"))
    dst = Sharding(cluster.mesh([1, 2]), P(None, ("host", "gpu"), None))
    shape = (12, 16, 5)
    glob = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    plan = plan_resharding(shape, "float64", src, dst, cluster, PlanOptions(strategy=strategy))
    with Runtime(cluster, backend="cuda") as rt:
        assert rt.backend.name == "cuda"
        shards = {d: fake_cupy.asarray(glob[tuple(slice(a, b) for a, b in r)])
                  for d, r in src.device_regions(shape).items()}
        out = rt.reshard_sync(plan, shards)
    for d, r in dst.device_regions(shape).items():
        np.testing.assert_array_equal(fake_cupy.asnumpy(out[d]),
                                      glob[tuple(slice(a, b) for a, b in r)])
    assert any(x.startswith("wait") for x in fake_cupy.launches)  # device-side waits used


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_toy_pipeline_through_the_cuda_backend(schedule, monkeypatch):
    from overlap.backends.devices import cuda

    device_waits = []
    real_waited = cuda.CudaDevices.waited

    def counting_waited(self, stream, event, *rest):  # (the kind's hook after a host wait)
        real_waited(self, stream, event, *rest)
        if event.native is not None:
            device_waits.append(event.label)

    monkeypatch.setattr(cuda.CudaDevices, "waited", counting_waited)
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = on_device(ToyMLP.build(cluster, hidden=8, batch=4))
    mbs = [np.random.default_rng(i).standard_normal((4, 8)) for i in range(3)]
    graph = lower(model.meshes, model.boundaries(), make_schedule(schedule, 4, len(mbs)),
                  cluster)
    with Runtime(cluster, backend="cuda") as rt:
        losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), graph=graph)
        tl = rt.timeline()  # from (GPU, event) trace marks
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    on_host(model).check_against(model.full_weights, ref_grads)
    assert len(tl.spans) > 0 and tl.iteration_time >= 0
    # Every wait of the step graph became a device-side wait on a recorded CUDA event (the
    # fake asserts the event was recorded before the wait was enqueued), and every lane first
    # waited for the caller's stream.
    entry = [w for w in device_waits if w == "the caller's stream"]
    assert len(device_waits) - len(entry) == sum(len(op.waits) for op in graph.ops) > 0
    assert len(entry) == len(graph.lanes)


def test_failure_through_the_cuda_backend_names_the_op():
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = on_device(ToyMLP.build(cluster, hidden=8, batch=4))  # as real CuPy needs
    stages = model.stages()
    good = stages[1].backward

    def bad(ctx, dy):
        if ctx.microbatch == 0 and ctx.device == 5:
            raise KeyError("injected")
        return good(ctx, dy)

    broken = list(stages)
    broken[1] = type(stages[1])(stages[1].mesh, stages[1].forward, bad)
    mbs = [np.ones((4, 8)) for _ in range(2)]
    with Runtime(cluster, backend="cuda", timeout=30) as rt:
        with pytest.raises(StreamError, match="B s1 mb0 on device 5"):
            rt.train_step_sync(broken, model.boundaries(), mbs,
                               input_sharding=model.input_sharding())
        losses = rt.train_step_sync(stages, model.boundaries(), mbs,
                                    input_sharding=model.input_sharding())
    assert np.allclose(losses, reference_step(model.full_weights, mbs)[0])


def test_a_stream_whose_thread_cannot_be_set_up_fails_its_call_naming_it(monkeypatch):
    # A CUDA error while a stream's thread makes its GPU and stream current (its first
    # item) fails the call at once with a StreamError that says so — the thread does not
    # die silently and leave the call to its timeout. The runtime still closes.
    def refused(self):
        raise RuntimeError("cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy")

    cluster = Cluster(2, 1, nic_gbps=10)
    src = Sharding(DeviceMesh([0], "a"), P())
    dst = Sharding(DeviceMesh([1], "a"), P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    monkeypatch.setattr(fake_cupy.Stream, "use", refused)
    # (Hung, it would end past the timeout with another error, naming no set-up.)
    named = "setting up its thread failed: RuntimeError: cudaErrorDevicesUnavailable"
    with Runtime(cluster, backend="cuda", timeout=60) as rt, \
            pytest.raises(StreamError, match=named):
        rt.reshard_sync(plan, {0: fake_cupy.arange(4, dtype=np.float32)})


# ---- what a review against CuPy 14.2 / NCCL found ---------------------------------------------


def test_reshard_into_out_buffers_on_the_cuda_backend():
    # CuPy's Flags has no ``writeable``: reading it raised AttributeError for every out=.
    cluster = Cluster.preset("p3.8xlarge", 2)
    src, dst = Sharding(cluster.mesh([0]), P()), Sharding(cluster.mesh([1]), P())
    plan = plan_resharding((4, 6), "float32", src, dst, cluster)
    glob = np.arange(24, dtype=np.float32).reshape(4, 6)
    out = {d: fake_cupy.empty((4, 6), np.float32) for d in dst.mesh.device_ids}
    assert not hasattr(out[4].flags, "writeable")
    with Runtime(cluster, backend="cuda") as rt:
        got = rt.reshard_sync(plan, {d: fake_cupy.asarray(glob) for d in src.mesh.device_ids},
                              out=out)
    for d in dst.mesh.device_ids:
        assert got[d] is out[d]
        np.testing.assert_array_equal(fake_cupy.asnumpy(out[d]), glob)


def test_device_work_that_never_completes_is_named_within_the_timeout(monkeypatch):
    # A kernel that never ends: the host's wait for it is bounded by the timeout, and the
    # waiter thread stranded in synchronize() holds up neither the error nor close().
    cluster = Cluster.preset("p3.8xlarge", 2)
    src, dst = Sharding(cluster.mesh([0]), P()), Sharding(cluster.mesh([1]), P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    try:
        with Runtime(cluster, backend="cuda", timeout=0.5) as rt:
            fake_cupy.hung.set()
            start = time.perf_counter()
            with pytest.raises(DeviceTimeout, match=r"never reached .*timeout") as info:
                rt.reshard_sync(plan, {d: fake_cupy.zeros(4, np.float32)
                                       for d in src.mesh.device_ids})
            assert time.perf_counter() - start <= 0.5 + 1.0
            assert "device" in info.value.event or "end" in info.value.event
        assert time.perf_counter() - start <= 0.5 + 3.0  # close() did not wait for the GPU
    finally:
        fake_cupy.hung.clear()


def test_a_device_fault_is_named_at_once_not_at_the_timeout(monkeypatch):
    # After an illegal address CUDA's synchronize() returns the error: the wait raises it,
    # naming the event, instead of waiting out the timeout.
    cluster = Cluster.preset("p3.8xlarge", 2)
    src, dst = Sharding(cluster.mesh([0]), P()), Sharding(cluster.mesh([1]), P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    with Runtime(cluster, backend="cuda", timeout=30.0) as rt:
        monkeypatch.setattr(fake_cupy, "sticky_error", True)
        start = time.perf_counter()
        with pytest.raises(DeviceFault, match=r"failed before reaching .*illegal") as info:
            rt.reshard_sync(plan, {d: fake_cupy.zeros(4, np.float32)
                                   for d in src.mesh.device_ids})
        assert time.perf_counter() - start < 10.0
        assert info.value.event and isinstance(info.value.__cause__, RuntimeError)


def test_host_waits_sleep_on_blocking_events_and_close_returns_the_pool(monkeypatch):
    # Waits go through blocking-sync events (a waiting thread sleeps; CUDA's default spins a
    # core), and close() gives back the pool's cached blocks of every stream it made: CuPy
    # reuses a freed block only on its own stream, so each closed runtime would strand its peak.
    waited = []
    real = fake_cupy.Event.synchronize
    monkeypatch.setattr(fake_cupy.Event, "synchronize",
                        lambda self: (waited.append(self.block), real(self))[1])
    # The lanes' ends complete well after the call got to them: the call waits on the host.
    monkeypatch.setattr(fake_cupy, "EVENT_LATENCY_S", 0.05)
    fake_cupy.pool_releases.clear()
    cluster = Cluster.preset("p3.8xlarge", 2)
    src, dst = Sharding(cluster.mesh([0]), P()), Sharding(cluster.mesh([1]), P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    with Runtime(cluster, backend="cuda") as rt:
        out = rt.reshard_sync(plan, {d: fake_cupy.arange(4, dtype=np.float32)
                                     for d in src.mesh.device_ids})
        ptrs = {(rt.backend.physical(s.device), s.native.ptr) for s in rt.backend.streams()
                if s.native is not None}
        assert fake_cupy.pool_releases == []
    assert waited and all(waited)
    assert ptrs and ptrs <= set(fake_cupy.pool_releases)
    assert list(fake_cupy.asnumpy(out[dst.mesh.device_ids[0]])) == [0, 1, 2, 3]


def two_gpus(monkeypatch) -> Backend:
    """A CUDA backend of two devices, each on a GPU of its own: NCCL between them."""
    monkeypatch.setattr(fake_cupy, "DEVICES", 2)
    return make_backend("cuda", 2, timeout=5.0)


def settled(events: list[Event], timeout: float = 10.0) -> list[BaseException | None]:
    """Block until every event is launched (fail the test past ``timeout``); their errors."""
    for ev in events:
        flag = threading.Event()
        ev.add_done_callback(lambda _, flag=flag: flag.set())
        assert flag.wait(timeout), f"{ev!r} did not complete within {timeout:g} s"
    return [ev.error for ev in events]


def run_on(backend: Backend, scope: CancelScope, fn, devices=(0, 1)):
    """``fn(d)`` as an op on each device's compute stream, for ``scope``; each stream's
    error once it got through (a failure cancels the scope: its later events fail too)."""
    events = []
    for d in devices:
        s = backend.stream(d, "compute")
        s.launch(f"op {d}", lambda d=d: fn(d), scope=scope)
        events.append(s.record(scope=scope))
    return settled(events)


@pytest.mark.parametrize("op, code", [(np.add, 0), (np.multiply, 1), (np.maximum, 2),
                                      (np.minimum, 3)])
def test_nccl_all_reduce_reduces_with_the_op_asked_for(monkeypatch, scope, op, code):
    backend = two_gpus(monkeypatch)
    try:
        errors = run_on(backend, scope, lambda d: backend.all_reduce(
            (0, 1), d, fake_cupy.ones(3), "t", op=op, namespace="g", scope=scope))
    finally:
        backend.close()
    assert errors == [None, None]
    assert sorted(c for c in fake_cupy.nccl_calls if c[0] == "allReduce") == [
        ("allReduce", 0, code), ("allReduce", 1, code)]


def test_nccl_all_reduce_refuses_an_op_nccl_lacks(monkeypatch, scope):
    backend = two_gpus(monkeypatch)
    try:
        start = time.perf_counter()
        errors = run_on(backend, scope, lambda d: backend.all_reduce(
            (0, 1), d, fake_cupy.ones(3), "t", op=np.subtract, namespace="g", scope=scope))
        # (refused before the rendezvous: no participant waits for the other's timeout)
        assert time.perf_counter() - start < backend.timeout
    finally:
        backend.close()
    assert all(isinstance(e, StreamError) and "op: NCCL reduces with" in str(e) for e in errors)
    assert isinstance(scope.failures[0], StreamError)
    assert "op: NCCL reduces with" in str(scope.failures[0])
    assert [c for c in fake_cupy.nccl_calls if c[0] == "allReduce"] == []


def aborts() -> list[tuple]:
    return sorted(c for c in fake_cupy.nccl_calls if c[0] == "abort")


def test_a_failed_nccl_send_still_ends_its_group_and_aborts_the_communicators(monkeypatch,
                                                                             scope):
    backend = two_gpus(monkeypatch)
    monkeypatch.setattr(fake_cupy.NcclCommunicator, "fail_sends", True)
    try:
        errors = run_on(backend, scope, lambda d: backend.broadcast(
            (0, 1), d, 0, fake_cupy.ones(3), "t", namespace="g", scope=scope))
        assert isinstance(errors[0], StreamError) and "ncclSend" in str(errors[0])
        assert scope.failures[0] is errors[0]  # the root's failure is the call's
        calls = [c[0] for c in fake_cupy.nccl_calls]
        assert calls.count("groupStart") == calls.count("groupEnd") == 1
        assert fake_cupy._group_depth[0] == 0
        # The failure cancelled the call, which aborts the communicators: a receiver whose
        # sender failed is not left spinning in its recv kernel.
        assert aborts() == [("abort", 0), ("abort", 1)]
    finally:
        backend.close()


def test_a_cancelled_call_aborts_the_communicators_and_the_next_makes_new_ones(monkeypatch):
    # A peer's failure (or Ctrl-C) cancels a call that NCCL ran well so far: its
    # communicators may hold work that now never completes, so they are aborted too.
    backend = two_gpus(monkeypatch)

    def broadcast(call):
        return lambda d: backend.broadcast((0, 1), d, 0, fake_cupy.ones(3), "t",
                                           namespace="g", scope=call)

    try:
        call = CancelScope("call 1")
        assert run_on(backend, call, broadcast(call)) == [None, None]
        assert aborts() == []
        call.cancel(CollectiveAborted("a peer failed"))
        assert aborts() == [("abort", 0), ("abort", 1)]
        later = CancelScope("call 2")
        assert run_on(backend, later, broadcast(later)) == [None, None]
        sends = [c for c in fake_cupy.nccl_calls if c[0] in ("send", "recv")]
        assert len(sends) == 4  # (one send and one recv per call)
        assert aborts() == [("abort", 0), ("abort", 1)]  # the new ones were not aborted
    finally:
        backend.close()


def test_a_participant_arriving_after_the_cancel_issues_no_nccl_call(monkeypatch):
    # The root waits at the host rendezvous; the call is cancelled (the root wakes and
    # fails); the receiver, whose op had already started, arrives last: the rendezvous lets
    # it through. It must not make fresh communicators (the abort cleared them) and enqueue
    # a recv whose sender never comes: on a GPU that kernel would spin for good.
    backend = two_gpus(monkeypatch)
    call = CancelScope("call")
    gate = threading.Event()

    def part(d):
        if d == 1:
            assert gate.wait(10.0)
        backend.broadcast((0, 1), d, 0, fake_cupy.ones(3), "t", namespace="g", scope=call)

    try:
        s0, s1 = backend.stream(0, "compute"), backend.stream(1, "compute")
        s0.launch("op 0", lambda: part(0), scope=call)
        s1.launch("op 1", lambda: part(1), scope=call)
        deadline = time.monotonic() + 10.0
        while [getattr(s.busy(), "label", None) for s in (s0, s1)] != ["op 0", "op 1"]:
            assert time.monotonic() < deadline, "the two ops never both ran"
            time.sleep(0.002)
        call.cancel(CollectiveAborted("a peer failed"))
        gate.set()
        settled([s0.record(scope=CancelScope("after")), s1.record(scope=CancelScope("after"))])
    finally:
        backend.close()
    assert [c for c in fake_cupy.nccl_calls if c[0] in ("send", "recv")] == []
    assert len(call.failures) == 2  # each participant's part ends as aborted
    assert all(isinstance(e, CollectiveAborted) for e in call.failures)


def test_nccl_calls_of_one_device_are_never_issued_from_two_threads_at_once(monkeypatch,
                                                                           scope):
    # A channel thread and the compute thread of one device, each on its own communicator:
    # NCCL documents concurrent calls on one device from several threads as unsafe.
    backend = two_gpus(monkeypatch)
    events = []
    try:
        for d in (0, 1):
            for _ in range(4):
                c, f = backend.stream(d, "compute"), backend.stream(d, "fwd0")
                c.launch("reduce", lambda d=d: backend.all_reduce(
                    (0, 1), d, fake_cupy.ones(3), "r", namespace="compute", scope=scope),
                    scope=scope)
                f.launch("bcast", lambda d=d: backend.broadcast(
                    (0, 1), d, 0, fake_cupy.ones(3), "b", namespace="fwd0", scope=scope),
                    scope=scope)
            events += [c.record(scope=scope), f.record(scope=scope)]
        errors = settled(events)
    finally:
        backend.close()
    assert errors == [None] * len(events)
    assert len([c for c in fake_cupy.nccl_calls if c[0] == "allReduce"]) == 8
    assert fake_cupy.concurrent_issue == []


def test_nccl_links_of_a_process_issue_one_call_at_a_time():
    # Across processes a rank drives one GPU; its channel and compute threads share it.
    from overlap.backends.job.nccl import NcclLinks

    links = NcclLinks(None, 0, timeout=5.0)
    # Two communicators (a channel's, a stage group's), this rank's GPU in each (opened as
    # the transport does, bootstrapped; with this one rank, no id travels).
    for key in ("fwd0", "compute"):
        links.open(key, [0])
    buf, out, stream = fake_cupy.ones(4), fake_cupy.ones((1, 4)), fake_cupy.Stream()

    def channel() -> None:
        for _ in range(5):
            links.send_many("fwd0", buf, [0], stream)

    def compute() -> None:
        for _ in range(5):
            links.all_reduce("compute", buf, stream)
            links.all_gather("compute", buf, out, stream)

    threads = [threading.Thread(target=channel), threading.Thread(target=compute)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        calls = [c[0] for c in fake_cupy.nccl_calls]
        assert calls.count("send") == calls.count("allReduce") == calls.count("allGather") == 5
        assert fake_cupy.concurrent_issue == []
    finally:
        links.close()


def test_nccl_links_aborted_by_a_cancelled_call_fail_later_calls_as_aborted():
    # A cancelled call aborts the links' communicators; a part of it still issuing fails as
    # a consequence (CollectiveAborted), never as a KeyError the call would name as its cause.
    from overlap.backends.job.nccl import NcclLinks

    links = NcclLinks(None, 0, timeout=5.0)
    links.open("fwd0", [0])
    buf, stream = fake_cupy.ones(4), fake_cupy.Stream()
    links.send_many("fwd0", buf, [0], stream)
    links.abort()
    assert aborts() == [("abort", 0)]
    for issue in (lambda: links.send_many("fwd0", buf, [0], stream),
                  lambda: links.recv("fwd0", buf, 0, stream),
                  lambda: links.all_reduce("fwd0", buf, stream),
                  lambda: links.all_gather("fwd0", buf, buf, stream)):
        with pytest.raises(CollectiveAborted, match="fwd0"):
            issue()
    links.close()


def test_a_call_runs_after_the_callers_stream_and_before_its_later_work():
    # Inputs made with cp.asarray (a copy on the caller's stream) may still be in flight when
    # the call starts; the caller's next kernels must not read results still being written.
    cluster = Cluster.preset("p3.8xlarge", 2)
    src, dst = Sharding(cluster.mesh([0]), P()), Sharding(cluster.mesh([1]), P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    with Runtime(cluster, backend="cuda") as rt, fake_cupy.Stream() as caller:
        shards = {d: fake_cupy.ones(4, np.float32) for d in src.mesh.device_ids}
        fake_cupy.waits.clear()
        rt.reshard_sync(plan, shards)
        used = {s.native.ptr for s in rt.backend.streams()}
    first_wait = {}
    for waiter, recorded_on in fake_cupy.waits:
        first_wait.setdefault(waiter, recorded_on)
    # Every stream the call used waited first for an event on the caller's stream ...
    assert used and all(first_wait[p] == caller.ptr for p in used), (first_wait, caller.ptr)
    # ... and the caller's stream then waited for every one of them.
    assert {rec for waiter, rec in fake_cupy.waits if waiter == caller.ptr} == used


def test_gpu_check_runs_end_to_end_on_the_stand_in(tmp_path):
    # The GPU machine's time is scarce: the one script it runs must not die on a script error.
    import os
    import subprocess

    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--self-test"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout.split("== gpu_check ==")[1]
    for row in ("GPU tests", "D2D copy peak", "loopback transfer", "pack / unpack",
                "completion seen", "signal step", "1f1b step", "eager-1f1b step"):
        assert row in table, table
    assert "FAILED" not in table
    assert "eager-1f1b step" in (tmp_path / "gpu_check.log").read_text()  # written as it went


def test_one_gpu_receives_into_strided_views_and_dependency_events_are_untimed(monkeypatch):
    # Loopback copies take strided destinations (no staging copy, which only NCCL needs);
    # events made only to be waited for are created without timing (cheaper): timing is paid
    # only for the trace's marks, whose times the timeline reads.
    made: list = []
    real_init = fake_cupy.Event.__init__

    def counting(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(fake_cupy.Event, "__init__", counting)
    waited: list = []  # events a CUDA stream was told to wait for
    real_wait = fake_cupy.Stream.wait_event
    monkeypatch.setattr(fake_cupy.Stream, "wait_event",
                        lambda self, ev: (waited.append(ev), real_wait(self, ev))[1])
    read: set = set()  # events whose time was read
    real_elapsed = fake_cupy.get_elapsed_time

    def elapsed(a, b):
        read.update((id(a), id(b)))
        return real_elapsed(a, b)

    monkeypatch.setattr(fake_cupy.cuda, "get_elapsed_time", elapsed)
    cluster = Cluster(3, 1, nic_gbps=10)
    src = Sharding(DeviceMesh([0], "a"), P())
    dst = Sharding(DeviceMesh([1, 2], "a"), P(None, "a"))  # column blocks
    plan = plan_resharding((4, 6), "float32", src, dst, cluster,
                           PlanOptions(strategy="send_recv", balance="none"))
    received = []
    from overlap.backends.devices.cuda import CudaLocal

    real_broadcast = CudaLocal.broadcast

    def watching(self, group, device, root, buffer, *a, **k):
        if device != root:
            received.append(buffer.flags.c_contiguous)
        return real_broadcast(self, group, device, root, buffer, *a, **k)

    monkeypatch.setattr(CudaLocal, "broadcast", watching)
    glob = np.arange(24, dtype=np.float32).reshape(4, 6)
    out = {d: fake_cupy.empty((4, 6), np.float32)[:, :3] for d in dst.mesh.device_ids}  # views
    with Runtime(cluster, backend="cuda") as rt:
        rt.reshard_sync(plan, {0: fake_cupy.asarray(glob)}, out=out, trace=True)
        assert len(rt.timeline().spans) == 2 * len(plan.transfers)  # reads every mark
    assert received and not any(received)  # into the strided views themselves
    np.testing.assert_array_equal(fake_cupy.asnumpy(out[1]), glob[:, :3])
    np.testing.assert_array_equal(fake_cupy.asnumpy(out[2]), glob[:, 3:])
    assert waited and made
    # Every event a stream waits for is untimed, unless it doubles as a trace mark (a
    # loopback's end, when the call records a trace); the host's waits are on untimed
    # blocking-sync events.
    assert [e for e in waited if e.timing and id(e) not in read] == []
    assert [e for e in made if e.block and e.timing] == []


def test_without_a_trace_a_loopback_times_nothing(monkeypatch, scope):
    # Work no trace records makes no timed event at all: two devices on one GPU broadcast
    # (a loopback copy), each stream's record is waited for.
    made: list = []
    real_init = fake_cupy.Event.__init__

    def counting(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(fake_cupy.Event, "__init__", counting)
    backend = make_backend("cuda", 2, timeout=5.0)
    try:
        bufs = {0: fake_cupy.arange(4, dtype=np.float32), 1: fake_cupy.zeros(4, np.float32)}
        errors = run_on(backend, scope, lambda d: backend.broadcast(
            (0, 1), d, 0, bufs[d], "t", namespace="g", scope=scope))
        assert errors == [None, None]
        after = backend.stream(1, "comm")
        after.wait_event(backend.stream(0, "compute").record(scope=scope), scope=scope)
        assert settled([after.record(scope=scope)]) == [None]
    finally:
        backend.close()
    assert list(fake_cupy.asnumpy(bufs[1])) == [0, 1, 2, 3]
    assert made and [e for e in made if e.timing] == []
    assert any(x.startswith("wait") for x in fake_cupy.launches)


def test_a_trace_touches_only_the_gpus_this_process_drives(monkeypatch):
    monkeypatch.setattr(fake_cupy, "DEVICES", 2)
    made: list = []
    real_init = fake_cupy.Event.__init__

    def counting(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(fake_cupy.Event, "__init__", counting)
    monkeypatch.setattr(fake_cupy, "profiler_calls", [])
    backend = make_backend("cuda", 1)  # one device, on GPU 0 of the two visible
    try:
        trace = backend.start_trace()
        assert set(trace.clock) == {0}  # (the CUDA kind's clock: a reference event per GPU)
        assert {e.device_id for e in made} == {0}
    finally:
        backend.close()
    # A rank of a multi-process job drives its own devices' GPUs only (here device 1: GPU 1).
    from overlap.backends.devices.cuda import CudaDevices

    made.clear()
    kind = CudaDevices()
    assert isinstance(kind, DeviceKind)  # (every member the backend and its streams use)
    backend = Backend(kind, 2, placement=Placement((0, 1)), rank=1)
    try:
        trace = backend.start_trace()
        assert set(trace.clock) == {1} and {e.device_id for e in made} == {1}
        backend.profiler(True)
        backend.profiler(False)
        assert fake_cupy.profiler_calls == [("start", 1), ("stop", 1)]
    finally:
        backend.close()


@pytest.mark.parametrize("api", [13, 14])
def test_a_bootstrapped_communicator_gets_the_id_type_its_cupy_takes(monkeypatch, api):
    # One rank (no peers): the id goes through the wire form and back into the constructor.
    from overlap.backends.job.nccl_bootstrap import bootstrap_nccl

    monkeypatch.setattr(fake_cupy, "NCCL_API", api)
    comm = bootstrap_nccl(None, [0], 0, fake_cupy.nccl, timeout=1.0)
    assert comm.rank_id() == 0 and comm.size() == 1


# ---- capture windows (cudaProfilerStart/Stop) -------------------------------------------------


def _toy_steps(rt, n, after_each):
    cluster = rt.cluster
    model = on_device(ToyMLP.build(cluster, hidden=8, batch=4))
    mbs = [fake_cupy.asarray(np.ones((4, 8))) for _ in range(2)]
    for _ in range(n):
        rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                           input_sharding=model.input_sharding())
        after_each(list(fake_cupy.profiler_calls))


@pytest.mark.parametrize("steps, env", [(range(1, 3), None), ("1:3", None), (None, "1:3")])
def test_profile_steps_start_the_profiler_before_a_step_and_stop_it_after(monkeypatch, steps,
                                                                         env):
    monkeypatch.setattr(fake_cupy, "profiler_calls", [])
    if env is None:
        monkeypatch.delenv("OVERLAP_PROFILE_STEPS", raising=False)
    else:
        monkeypatch.setenv("OVERLAP_PROFILE_STEPS", env)
    cluster = Cluster.preset("p3.8xlarge", 4)
    seen = []
    with Runtime(cluster, backend="cuda", profile_steps=steps) as rt:
        _toy_steps(rt, 4, seen.append)
    gpus = sorted({rt.backend.physical(d) for d in range(cluster.num_devices)})
    starts = [("start", g) for g in gpus]
    stops = [("stop", g) for g in gpus]
    # after step 0: nothing; step 1 ran captured; after step 2 the window closed; step 3 not.
    assert seen == [[], starts, starts + stops, starts + stops]


def test_capture_records_a_block_and_close_ends_an_open_window(monkeypatch):
    monkeypatch.setattr(fake_cupy, "profiler_calls", [])
    cluster = Cluster.preset("p3.8xlarge", 4)
    with monkeypatch.context() as m:
        m.setattr(fake_cupy, "DEVICES", 2)
        with Runtime(cluster, backend="cuda") as rt:
            with rt.capture():
                assert fake_cupy.profiler_calls == [("start", 0), ("start", 1)]
            assert fake_cupy.profiler_calls[2:] == [("stop", 0), ("stop", 1)]
    fake_cupy.profiler_calls.clear()
    rt = Runtime(cluster, backend="cuda", profile_steps=range(0, 5))
    _toy_steps(rt, 1, lambda calls: None)
    gpus = sorted({rt.backend.physical(d) for d in range(cluster.num_devices)})
    rt.close()  # the window was still open: closing the runtime ends it
    assert fake_cupy.profiler_calls == ([("start", g) for g in gpus] +
                                        [("stop", g) for g in gpus])


def test_a_step_lets_go_of_its_buffers_when_it_returns():
    # Buffers an op is done with are kept until the GPU has run the op; the host usually runs
    # far ahead, so nearly a whole step's were still kept when it returned (seen on an H200:
    # 105 GiB in use after a 1f1b step of 16 × 1 GiB microbatches, 17 GiB of them inputs).
    import weakref

    cluster = Cluster(4, 1, nic_gbps=400.0)
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(4)]
    shape = (8, 4)
    seen: list = []

    def fwd(s):
        def f(ctx, x):
            seen.append(weakref.ref(x))
            return x.sum() * 0 if s == 3 else x * 1.0
        return f

    def bwd(s):
        def b(ctx, dy):
            if dy is not None:
                seen.append(weakref.ref(dy))
            return None if s == 0 else fake_cupy.ones(shape, np.float32)
        return b

    from overlap import Stage
    from scheduler import Boundary

    stages = [Stage(m, fwd(s), bwd(s)) for s, m in enumerate(meshes)]
    bounds = [Boundary(shape, "float32", Sharding(meshes[s], P()),
                       Sharding(meshes[s + 1], P())) for s in range(3)]
    mbs = [fake_cupy.ones(shape, np.float32) for _ in range(6)]
    with Runtime(cluster, backend="cuda") as rt:
        rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(meshes[0], P()),
                           schedule="1f1b")
        assert len(seen) == 4 * 6 + 3 * 6
        assert [r for r in seen if r() is not None] == []


def test_a_stage_collective_leaves_its_computes_span_alone():
    # A compute's own all_reduce runs a loopback copy with its own start and end events;
    # only a transfer op's span is its copy's (review, 2026-11-30: F measured 0.04 ms).
    cluster = Cluster(1, 2, nic_gbps=400.0)
    mesh = DeviceMesh([[0, 1]], ("host", "gpu"))

    def fwd(ctx, x):
        time.sleep(0.02)  # the op lasts at least this long, whatever the machine's load
        return ctx.all_reduce(x.sum().reshape(1))[0] * 0

    from overlap import Stage

    mbs = [fake_cupy.ones((4, 2), np.float32)]
    with Runtime(cluster, backend="cuda") as rt:
        rt.train_step_sync([Stage(mesh, fwd, lambda ctx, dy: None)], [], mbs,
                           input_sharding=Sharding(mesh, P()))
        spans = [s for s in rt.timeline().spans if s.kind == "F"]
    assert len(spans) == 2 and all(s.end - s.start >= 0.02 for s in spans)


def test_a_loopback_across_two_gpus_times_its_copy_on_the_gpu_that_ran_it(monkeypatch):
    # Devices 0, 1, 2 on 2 GPUs (0, 1, 0): not all distinct, so a loopback on the last
    # arriver's stream; every participant's span must name that stream's GPU.
    monkeypatch.setattr(fake_cupy, "DEVICES", 2)
    monkeypatch.setattr(fake_cupy.runtime, "memcpyPeerAsync", lambda *a: None)
    cluster = Cluster(1, 3, nic_gbps=400.0)
    mesh = DeviceMesh([[0, 1, 2]], ("host", "gpu"))
    src, dst = Sharding(DeviceMesh([[0]], ("host", "gpu")), P()), Sharding(mesh, P())
    plan = plan_resharding((4,), "float32", src, dst, cluster)
    from overlap.backends.devices.cuda import CudaDevices

    seen = []
    real = CudaDevices.joined

    def joined(self, landed):  # (the kind's hook: a participant's stream after the copy)
        real(self, landed)
        span = current_stream().data_span
        if span is not None:
            seen.append([(gpu, ev.device_id) for gpu, ev in span])

    monkeypatch.setattr(CudaDevices, "joined", joined)
    with Runtime(cluster, backend="cuda") as rt:
        rt.reshard_sync(plan, {0: fake_cupy.arange(4, dtype=np.float32)}, trace=True)
        spans = rt.timeline().spans  # each mark read against its GPU's reference event
    assert seen and all(gpu == dev for pairs in seen for gpu, dev in pairs)
    assert {s.device for s in spans} == {0, 1, 2}
    assert all(0 <= s.start <= s.end for s in spans)


def test_waits_stuck_on_endless_kernels_never_starve_later_ones():
    # Waiter threads stuck in synchronize() (kernels that never end) once left later waits
    # queued behind them, failing with DeviceTimeout on events that had completed.
    from overlap.backends.devices.cuda import WAITER_THREADS, CudaDevices

    gate = threading.Event()

    class Endless:
        done = False

        def synchronize(self):
            gate.wait()

    kind = CudaDevices(timeout=0.3)  # (its own completion waiters)

    async def wait(native):
        ev = Event("x")
        ev.native = native
        await kind.device_wait(ev)

    async def main():
        for _ in range(WAITER_THREADS + 1):
            with pytest.raises(DeviceTimeout):
                await wait(Endless())
        soon = fake_cupy.Event(block=True)
        soon.record(fake_cupy.cuda.Stream())
        await wait(soon)  # completes 1 ms after its record: no DeviceTimeout
        # The waiters themselves answer (not only the wait's own look at Event.done): a
        # spare thread took the job while every other one is stuck.
        later = fake_cupy.Event(block=True)
        later.record(fake_cupy.cuda.Stream())
        answered = OneShot()
        kind.waiters.watch(later, answered)
        assert await wait_on(answered, None, "the waiter's answer", 5.0) is True
        assert answered.error is None

    try:
        asyncio.run(main())
    finally:
        gate.set()
        kind.close([])


def test_a_laned_plan_runs_on_nccl_with_a_communicator_per_lane(monkeypatch):
    # Four GPUs: devices 0 and 1 each send a piece to devices 2 and 3, on two lanes; each
    # lane is a stream of its own on every GPU, with its own NCCL communicator. (The
    # stand-in's NCCL issues calls but moves no bytes: the data itself is checked on the CPU
    # backend, tests/test_lanes.py, and on a GPU by gpu_check.)
    import dataclasses

    monkeypatch.setattr(fake_cupy, "DEVICES", 4)
    cluster = Cluster(2, 2, nic_gbps=100.0)
    src = Sharding(DeviceMesh([0, 1], "x"), P("x"))
    dst = Sharding(DeviceMesh([2, 3], "x"), P(None, "x"))
    shape = (8, 6)
    plan = plan_resharding(shape, "float32", src, dst, cluster, PlanOptions(balance="none"))
    plan = dataclasses.replace(plan, transfers=tuple(
        dataclasses.replace(t, lane=k % 2) for k, t in enumerate(plan.transfers)))
    plan.check()
    # Which communicators NCCL made (one initAll per communicator of the group), and which
    # of them each stream issued its calls on.
    made: list[list] = []
    real_init_all = fake_cupy.NcclCommunicator.initAll.__func__

    def init_all(cls, devices):
        comms = real_init_all(cls, devices)
        made.append(comms)
        return comms

    monkeypatch.setattr(fake_cupy.NcclCommunicator, "initAll", classmethod(init_all))
    issued: dict[str, set[int]] = {}
    real_use = fake_cupy.NcclCommunicator._use

    def use(self, what, *args):
        k = next(i for i, comms in enumerate(made) if any(c is self for c in comms))
        issued.setdefault(current_stream().name, set()).add(k)
        real_use(self, what, *args)

    monkeypatch.setattr(fake_cupy.NcclCommunicator, "_use", use)
    with Runtime(cluster, backend="cuda") as rt:
        rt.reshard_sync(plan, {d: fake_cupy.zeros(region_shape(r), np.float32)
                               for d, r in src.device_regions(shape).items()}, trace=True)
        streams = {(s.device, s.stream) for s in rt.timeline().spans}
    lanes = {(d, "comm.1" if t.lane else "comm") for t in plan.transfers for d in t.devices}
    assert streams == lanes and {s for _, s in lanes} == {"comm", "comm.1"}
    # A communicator per lane: each lane's calls on one of its own, the two lanes' apart.
    assert set(issued) == {"comm", "comm.1"} and len(made) == 2
    assert all(len(k) == 1 for k in issued.values()) and issued["comm"] != issued["comm.1"]
    sends = [c for c in fake_cupy.nccl_calls if c[0] == "send"]
    assert len(sends) == len(plan.transfers)
    assert fake_cupy.concurrent_issue == []  # still one NCCL call at a time per GPU


def test_a_step_waits_for_one_completion_whatever_its_lanes(monkeypatch):
    # With the GPU behind the host, every lane's end is launched but not yet passed when the
    # step's ops are: the call joins them on the GPU and sleeps on ONE event (one waiter
    # job, one wake-up of the loop), not one per lane.
    from overlap import Stage
    from overlap.backends.devices.cuda import CompletionWaiters
    from scheduler import Boundary

    monkeypatch.setattr(fake_cupy, "EVENT_LATENCY_S", 0.05)
    watched = []
    real_watch = CompletionWaiters.watch

    def counting_watch(self, event, *rest):
        watched.append(event)
        real_watch(self, event, *rest)

    monkeypatch.setattr(CompletionWaiters, "watch", counting_watch)
    cluster = Cluster(4, 1, nic_gbps=400.0)
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(4)]
    shape = (8, 4)
    grad = fake_cupy.ones(shape, np.float32)

    def fwd(s):
        return lambda ctx, x: x.sum() * 0 if s == 3 else x * 1.0

    def bwd(s):
        return lambda ctx, dy: None if s == 0 else grad

    stages = [Stage(m, fwd(s), bwd(s)) for s, m in enumerate(meshes)]
    bounds = [Boundary(shape, "float32", Sharding(meshes[s], P()),
                       Sharding(meshes[s + 1], P())) for s in range(3)]
    mbs = [fake_cupy.ones(shape, np.float32) for _ in range(4)]
    with Runtime(cluster, backend="cuda") as rt:
        graph = lower(meshes, bounds, make_schedule("1f1b", 4, len(mbs)), cluster)
        rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(meshes[0], P()),
                           graph=graph)
        assert len(graph.lanes) > 1
        assert len(watched) == 1
        waiters = [t for t in threading.enumerate() if t.name.startswith("overlap-cuda-waiter")]
        assert len(waiters) <= 4  # (the first use starts the pool: none more)


def test_a_stage_function_runs_on_its_gpu_and_stream_whatever_the_last_one_left(monkeypatch):
    # A stream's thread makes its GPU and CUDA stream current once; a stage function that
    # leaves another CUDA stream current (``Stream().use()``) does not move the ops after
    # it: each runs on its own stream again.
    from overlap import Stage
    from scheduler import Boundary

    cluster = Cluster(2, 1, nic_gbps=10)
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(2)]
    seen: list[tuple[int, int, bool]] = []  # (stage, current GPU, its stream current)

    with Runtime(cluster, backend="cuda") as rt:
        def forward(s):
            def f(ctx, x):
                seen.append((s, fake_cupy.cuda.runtime.getDevice(),
                             fake_cupy.cuda.get_current_stream() is rt.backend.current_stream()))
                if s == 0:  # leaves a stream of its own current
                    fake_cupy.cuda.Stream(non_blocking=True).use()
                    return x * 2
                return (x * 3).sum()
            return f

        def backward(s):
            return lambda ctx, dy: None if s == 0 else fake_cupy.ones((2, 4), np.float32)

        stages = [Stage(m, forward(s), backward(s)) for s, m in enumerate(meshes)]
        bounds = [Boundary((2, 4), "float32", Sharding(meshes[0], P()), Sharding(meshes[1], P()))]
        mbs = [fake_cupy.ones((2, 4), np.float32) for _ in range(3)]
        for _ in range(2):
            losses = rt.train_step_sync(stages, bounds, mbs, schedule="1f1b",
                                        input_sharding=Sharding(meshes[0], P()))
            assert [float(v) for v in losses] == [48.0] * 3
    assert len(seen) == 12 and all(gpu == 0 and mine for _, gpu, mine in seen)


def test_a_held_buffer_lives_until_the_gpu_passed_the_op_that_held_it(monkeypatch, scope):
    # CuPy has no record_stream: a buffer an op is done with (``Backend.hold``) must outlive
    # the op's device work, or the pool hands its block to a later allocation while a kernel
    # still reads it. Here the GPU runs 0.3 s behind the host: the buffer stays alive after
    # its op returned and after the stream's next record was launched, and is let go once
    # the device passed that record.
    import weakref

    monkeypatch.setattr(fake_cupy, "EVENT_LATENCY_S", 0.3)
    backend = make_backend("cuda", 1, timeout=5.0)
    try:
        stream = backend.stream(0, "compute")
        ref: list = []

        def op() -> None:
            buf = fake_cupy.ones(16, np.float32)
            ref.append(weakref.ref(buf))
            backend.hold(buf)

        stream.launch("holds", op, scope=scope)
        assert settled([stream.record(scope=scope)]) == [None]
        assert ref[0]() is not None  # launched, not passed by the device yet
        end = stream.record(scope=scope)
        assert settled([end]) == [None]
        backend.devices.let_go()  # (what release_to_caller does after a call)
        assert ref[0]() is not None
        deadline = time.perf_counter() + 5.0
        while not end.done() and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert end.done()
        backend.devices.let_go()
        assert ref[0]() is None
    finally:
        backend.close()
