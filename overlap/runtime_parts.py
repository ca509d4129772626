"""What a runtime is made of, made from its arguments (checked before any thread or process
starts), and ended.

:func:`make_parts` checks ``Runtime(...)``'s arguments — each bad one named — and builds the
parts: the backend, the runtime's scope, its calls (:mod:`overlap.call`), its step-graph
cache (:mod:`overlap.step_graph_cache`), its measurements (:mod:`overlap.measurements`) and
the ``*_sync`` calls' loop (:mod:`overlap.sync_loop`). The modules that run a call receive
them as one :class:`RuntimeParts`. None of them holds the runtime itself, so a runtime
dropped without ``close()`` is collected, and :func:`collected` ends its threads.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from scheduler import Cluster, CostModel, check_seconds

from .backends import Backend, make_backend
from .call import Calls
from .errors import CollectiveAborted
from .hang_dump import hang_dump
from .measurements import Measurements
from .profiling import Profiler, profile_window
from .scope import CancelScope
from .step_graph_cache import StepGraphCache
from .sync_loop import SyncLoop
from .world import Placement, World, detect_world

log = logging.getLogger("overlap")


@dataclass(frozen=True)
class RuntimeParts:
    """A runtime's parts (see module doc). ``tags`` names the messages of standalone
    reshardings across ranks."""

    cluster: Cluster
    world: World
    backend: Backend
    scope: CancelScope  # the runtime's: the parent of every call's
    calls: Calls
    graphs: StepGraphCache
    measure: Measurements
    sync: SyncLoop
    compute_time: Callable[[int, str], float] | None
    tags: TagRanges

    @property
    def distributed(self) -> bool:
        return self.world.distributed

    def array_types(self) -> tuple[type, ...]:
        """The arrays a call takes: numpy's, and on a GPU the device kind's (CuPy's)."""
        xp = self.backend.xp
        return (np.ndarray,) if xp is np else (np.ndarray, xp.ndarray)


class TagRanges:
    """Each standalone resharding's message tags across processes: a range of its own, as
    many tags as its graph has ops, taken from a running total when it launches. Calls
    launch one at a time and in the same order on every rank, so every rank takes the same
    ranges. (Calls of different sizes numbered ``call × ops + op`` shared tags: a rank ahead
    in a later call could then take a slower peer's message of an earlier call as its own
    wherever the two calls met on a channel.) Tags wrap at the transport's bound, far
    beyond any two calls in flight at once."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, ops: int) -> int:
        """The first tag of a new range of ``ops`` tags."""
        first, self.taken = self.taken, self.taken + ops
        return first


def make_parts(cluster: Cluster, backend: str, *, emulate_links: bool | str,
               compute_time: Callable[[int, str], float] | None, timeout: float,
               world: World | None, placement: Placement | None,
               profile_steps: range | str | None, hang_tracebacks: bool | IO[str]
               ) -> RuntimeParts:
    """``Runtime(...)``'s arguments checked, in order, then its parts made."""
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    check_seconds("timeout", timeout)  # before any thread or process is started
    dump = hang_dump(hang_tracebacks, timeout)
    window = profile_window(profile_steps)
    world, placement = _world_and_placement(cluster, world, placement, emulate_links)
    if compute_time is not None and not callable(compute_time):
        raise TypeError("compute_time: expected a callable (stage, kind) -> seconds")
    if emulate_links not in (False, True, "signal"):
        raise ValueError(f"emulate_links: expected True, False or 'signal', got "
                         f"{emulate_links!r}")
    made = make_backend(backend, cluster.num_devices, timeout=timeout,
                        link_time=_link_time(cluster, emulate_links), world=world,
                        placement=placement)
    # The runtime's own scope: the parent of every call's. Closing the runtime cancels it;
    # across processes a peer's failure does (the job cannot go on).
    scope = CancelScope("the runtime")
    if made.dist is not None:
        made.dist.scope = scope
    if world.distributed:
        # At DEBUG: every runtime of every rank would otherwise print it (a script that
        # makes many runtimes printed little else). The guard names a killed rank itself.
        log.debug("%s", made.dist.describe())
    measure = Measurements(made, Profiler(made, window))
    graphs = StepGraphCache(cluster, made, distributed=world.distributed,
                            compute_time=compute_time, measured=measure.compute_means)
    return RuntimeParts(cluster, world, made, scope, Calls(made, scope, dump), graphs, measure,
                        SyncLoop(), compute_time, TagRanges())


def _world_and_placement(cluster: Cluster, world: World | None, placement: Placement | None,
                         emulate_links: bool | str) -> tuple[World, Placement | None]:
    """The arguments ``world`` and ``placement`` checked (TypeError/ValueError naming them),
    with their defaults: the launcher's world, equal contiguous blocks of devices."""
    if world is not None and not isinstance(world, World):
        raise TypeError(f"world: expected an overlap.world.World, got {type(world).__name__}")
    if placement is not None and not isinstance(placement, Placement):
        raise TypeError(f"placement: expected an overlap.world.Placement, got "
                        f"{type(placement).__name__}")
    world = detect_world() if world is None else world
    if world.distributed:
        if emulate_links:
            raise ValueError("emulate_links: link emulation plays a cluster inside one "
                             "process; it is not available in a multi-process job")
        # (the backend checks that it covers the cluster, before any work)
        placement = placement or _blocks(cluster, world)
    elif placement is not None and set(placement.owners) != {0}:
        raise ValueError("placement: a one-process world owns every device")
    return world, placement


def _blocks(cluster: Cluster, world: World) -> Placement:
    """The default placement, its error naming a caller's process group as the world (its
    size is the caller's choice, not a launcher's flag)."""
    try:
        return Placement.blocks(cluster.num_devices, world.size)
    except ValueError as exc:
        if world.source != "process_group":
            raise
        raise ValueError(f"{exc} (this world is the torch.distributed default process group "
                         f"the caller initialized: world_size={world.size}, rank "
                         f"{world.rank}; make the group with a divisor of the cluster's "
                         f"{cluster.num_devices} devices)") from None


def _link_time(cluster: Cluster, emulate: bool | str
               ) -> Callable[[int, Sequence[int], int], float] | None:
    """Link emulation: each transfer lasts at least the cost model's time for it alone
    (``"signal"``: its latency only), from the same functions the simulator costs it with."""
    model = CostModel(cluster)
    if emulate == "signal":
        return lambda root, receivers, nbytes: model.latency_of(root, tuple(receivers))
    if emulate:
        return lambda root, receivers, nbytes: model.alone_seconds(root, tuple(receivers),
                                                                   nbytes)
    return None


def close_parts(parts: RuntimeParts, error: BaseException | None, handled: bool) -> None:
    """Close the runtime: no call runs again, a profiler window left open ends, across
    processes the peers are told (``error``: the exception leaving a ``with`` block — the
    others then hear this rank failed, not that it left; ``handled``: the job may go on),
    and every thread ends."""
    parts.calls.closed = True
    with contextlib.suppress(Exception):  # a window left open ends with the runtime
        parts.measure.profiler.switch(False)
    if parts.backend.dist is not None:
        parts.backend.dist.leave(error, handled)
    shut_down(parts.scope, parts.backend, parts.sync)


def shut_down(scope: CancelScope, backend: Backend, sync: SyncLoop) -> None:
    """Cancel whatever still runs, end the backend's threads and the sync calls' loop."""
    scope.cancel(CollectiveAborted("the runtime closed"))
    backend.close()
    sync.close()


def collected(scope: CancelScope, backend: Backend, sync: SyncLoop, what: str) -> None:
    """A runtime dropped without ``close()``: its threads are ended anyway, with a warning
    (as files and event loops do). It takes these three parts alone — not the calls, whose
    kept error (a lost stream), raised again, holds the runtime's frames."""
    warnings.warn(f"unclosed overlap.Runtime ({what}): its threads are ended now; call "
                  "close(), or use `with overlap.Runtime(...) as rt:`", ResourceWarning,
                  stacklevel=2)
    shut_down(scope, backend, sync)


def check_bound(timeout: Any) -> None:
    """A call's own bound: None (the runtime's) or seconds > 0 (ValueError naming it)."""
    if timeout is not None:
        check_seconds("timeout", timeout)


__all__ = ["RuntimeParts", "check_bound", "close_parts", "collected", "make_parts", "shut_down"]
