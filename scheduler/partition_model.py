"""What :func:`scheduler.partition` searches over, and how it costs a candidate.

A model is a chain of :class:`Layer` s. A **stage** is a contiguous range of layers run on a
**submesh** of the cluster, tensor-parallel over all of its devices (its TP degree is its
size: the runtime's replicas would each run the whole microbatch, so a replicated device
would only add work). Submeshes are Alpa's shapes: ``1 × g`` inside one host for every ``g``
dividing the GPUs per host, and ``h × G`` whole hosts. Stages are laid out in pipeline order
on the host-major device list: each starts at the next free device aligned to its size
(``g`` inside a host, a host boundary for whole hosts) — so a submesh never straddles hosts,
and devices left over stay idle.

The **estimate** of a candidate (what the search minimises) is the pipeline's fill and drain
plus ``m − 1`` periods of its slowest term, with every boundary's transfers on the critical
path once each way:

    E = Σ_s (F_s + B_s) + Σ_b (x_b→ + x_b←) + (m − 1) · max(max_s (F_s + B_s), max_b x_b→,
                                                           max_b x_b←)

``F_s``, ``B_s``: the stage's layers' seconds at its TP degree; ``x_b→``, ``x_b←``: the cost
model's estimate (:func:`scheduler.estimate`) of boundary ``b``'s activation and gradient
resharding, planned with the search's strategy and the cheap ``size`` balance. With free
transfers and a backward proportional to the forward it is exactly GPipe's iteration time
in the simulator, and no less than 1F1B's (``tests/test_partition.py`` checks both); the
finalists are then simulated for real. A stage fits its devices when its parameters and the
activations of the microbatches 1F1B keeps there (``min(m, p − s)``) fit
``memory_per_device``: both are divided by the TP degree.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import Any

from .cluster import Cluster
from .cost import estimate
from .dtypes import check_dtype
from .errors import check_positive_int
from .mesh import DeviceMesh
from .planner import PlanOptions, check_nbytes, plan_resharding
from .sharding import Sharding, ShardingSpec, check_shape

TP_AXIS = "tp"  # the one mesh axis of a stage's submesh: its devices split its layers
Stage = tuple[int, int, int, int]  # (first layer, stop layer, first device, size)


class PartitionError(ValueError):
    """No partition fits: names the stage (or layer) that cannot fit and what it needs."""


def _seconds_map(value: object, argument: str) -> dict[int, float]:
    """``{tp degree: seconds}`` checked: ints >= 1 to finite numbers >= 0."""
    if not isinstance(value, Mapping) or not value:
        raise TypeError(f"{argument}: expected a non-empty mapping of TP degree -> seconds per "
                        f"microbatch, got {value!r}")
    out: dict[int, float] = {}
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{argument}: TP degrees are ints >= 1, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{argument}[{k}]: expected finite seconds >= 0, got {v!r}")
        out[k] = float(v)
    return dict(sorted(out.items()))


def _spec(value: object, argument: str) -> ShardingSpec:
    spec = value if isinstance(value, ShardingSpec) else None
    if spec is None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{argument}: expected a ShardingSpec (P(...)) over axis "
                            f"{TP_AXIS!r}, got {value!r}")
        spec = ShardingSpec(*value)
    bad = [a for a in spec.axes() if a != TP_AXIS]
    if bad:
        raise ValueError(f"{argument}: {spec!r} names axes {bad}; a stage's submesh has the one "
                         f"axis {TP_AXIS!r}")
    return spec


def _bytes(value: object, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{argument}: expected bytes (an int >= 0), got {value!r}")
    return value


@dataclass(frozen=True)
class Layer:
    """One layer of a model chain, as :func:`scheduler.partition` sees it.

    Args:
        forward, backward: TP degree -> seconds per microbatch on each device of a stage of
            that degree (the degrees listed are the ones the layer supports; the same for
            both).
        output_shape, dtype: the activation it hands to the next layer, per microbatch.
        params_bytes: bytes of its parameters as you count them (weights, gradients,
            optimizer state); a stage of TP degree t keeps ``params_bytes / t`` per device.
        activation_bytes: bytes it keeps per microbatch between its forward and backward;
            ``activation_bytes / t`` per device.
        input_grad, weight_grad: optional, both or neither (same degrees): the backward split
            into its input gradient and its weight gradient (zb-h1 and the comm-aware lists
            then may use them).
        output_spec, input_spec: the layout, over the stage's axis ``"tp"``, of its output
            when it runs tensor-parallel (``P(None, "tp")``: sharded along dim 1), and the
            layout it wants its input in (``P()``: replicated, the default for both).
        name: for messages and tables.
    """

    forward: Mapping[int, float]
    backward: Mapping[int, float]
    output_shape: tuple[int, ...]
    dtype: str
    params_bytes: int
    activation_bytes: int
    _: KW_ONLY
    input_grad: Mapping[int, float] | None = None
    weight_grad: Mapping[int, float] | None = None
    output_spec: ShardingSpec = field(default_factory=ShardingSpec)
    input_spec: ShardingSpec = field(default_factory=ShardingSpec)
    name: str = ""

    def __post_init__(self) -> None:
        fwd = _seconds_map(self.forward, "forward")
        bwd = _seconds_map(self.backward, "backward")
        if set(bwd) != set(fwd):
            raise ValueError(f"backward: degrees {sorted(bwd)} differ from forward's "
                             f"{sorted(fwd)}")
        split = (self.input_grad, self.weight_grad)
        if (split[0] is None) != (split[1] is None):
            raise ValueError("input_grad, weight_grad: give both (the split backward) or "
                             "neither")
        split_maps = [None if s is None else _seconds_map(s, n)
                      for s, n in zip(split, ("input_grad", "weight_grad"))]
        for m, n in zip(split_maps, ("input_grad", "weight_grad")):
            if m is not None and set(m) != set(fwd):
                raise ValueError(f"{n}: degrees {sorted(m)} differ from forward's {sorted(fwd)}")
        shape = check_shape(self.output_shape, argument="output_shape")
        dt = check_dtype(self.dtype)
        check_nbytes(shape, dt, "output_shape")
        out_spec = _spec(self.output_spec, "output_spec")
        out_spec.padded(len(shape))
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {self.name!r}")
        for name, value in (("forward", fwd), ("backward", bwd), ("input_grad", split_maps[0]),
                            ("weight_grad", split_maps[1]), ("output_shape", shape),
                            ("dtype", dt.name), ("output_spec", out_spec),
                            ("input_spec", _spec(self.input_spec, "input_spec")),
                            ("params_bytes", _bytes(self.params_bytes, "params_bytes")),
                            ("activation_bytes",
                             _bytes(self.activation_bytes, "activation_bytes"))):
            object.__setattr__(self, name, value)

    __hash__ = None  # type: ignore[assignment]  (its cost tables are dicts)

    @property
    def degrees(self) -> tuple[int, ...]:
        """The TP degrees it supports."""
        return tuple(self.forward)

    @property
    def split(self) -> bool:
        """Whether its backward is given as input-grad and weight-grad (zero-bubble)."""
        return self.input_grad is not None

    @property
    def output_bytes(self) -> int:
        """Bytes of its whole (unsharded) output activation per microbatch."""
        return math.prod(self.output_shape) * check_dtype(self.dtype).itemsize

    def seconds(self, degree: int) -> float:
        """Forward plus backward at ``degree``."""
        return self.forward[degree] + self.backward[degree]

    @classmethod
    def from_flops(cls, forward_flops: float, output_shape: Sequence[int], dtype: str,
                   params_bytes: int, activation_bytes: int, *, cluster: Cluster,
                   device_flops: float, degrees: Sequence[int] = (1,),
                   collectives: int = 0, collective_bytes: int = 0,
                   backward_ratio: float = 2.0, split: bool = False,
                   **kwargs: Any) -> Layer:
        """A layer costed from its FLOPs at ``device_flops`` per device, its work split over
        the TP degree, plus ``collectives`` all-reduces of ``collective_bytes`` per forward
        (as many per backward: Megatron's two per transformer block each way), each costed
        as twice the cost model's lower bound of an all-gather of those bytes over the
        degree's first devices (a ring all-reduce: a reduce-scatter and an all-gather).
        ``split``: the backward's compute halved into input and weight gradient (the
        collectives go with the input gradient)."""
        if not (isinstance(device_flops, numbers.Real) and device_flops > 0):
            raise ValueError(f"device_flops: expected FLOP/s > 0, got {device_flops!r}")
        fwd, bwd, ig, wg = {}, {}, {}, {}
        for t in degrees:
            check_positive_int("degrees", t)
            comm = collectives * all_reduce_seconds(collective_bytes, t, cluster)
            compute = forward_flops / (t * device_flops)
            fwd[t], bwd[t] = compute + comm, backward_ratio * compute + comm
            ig[t], wg[t] = backward_ratio * compute / 2 + comm, backward_ratio * compute / 2
        if split:
            kwargs.update(input_grad=ig, weight_grad=wg)
        return cls(fwd, bwd, tuple(output_shape), dtype, params_bytes, activation_bytes,
                   **kwargs)


def all_reduce_seconds(nbytes: int, degree: int, cluster: Cluster) -> float:
    """A ring all-reduce of ``nbytes`` over the cluster's first ``degree`` devices: twice the
    cost model's lower bound of an all-gather of them (0 for one device)."""
    from .cost import lower_bound_for

    if degree == 1 or nbytes == 0:
        return 0.0
    if degree > cluster.num_devices:
        raise ValueError(f"degrees: {degree} devices, the cluster has {cluster.num_devices}")
    mesh = DeviceMesh(list(range(degree)), (TP_AXIS,))
    return 2 * lower_bound_for((nbytes,), "uint8", Sharding(mesh, ShardingSpec(TP_AXIS)),
                               Sharding(mesh, ShardingSpec()), cluster)


def submesh_sizes(cluster: Cluster) -> tuple[int, ...]:
    """Alpa's submesh sizes: ``g`` dividing the GPUs per host, and whole hosts."""
    g = cluster.gpus_per_host
    inside = [d for d in range(1, g + 1) if g % d == 0]
    return tuple(inside + [h * g for h in range(2, cluster.num_hosts + 1)])


def submesh_shape(size: int, cluster: Cluster) -> tuple[int, int]:
    """(hosts, GPUs per host) of a submesh of ``size`` devices."""
    g = cluster.gpus_per_host
    return (1, size) if size <= g else (size // g, g)


def placed(next_free: int, size: int, cluster: Cluster) -> int:
    """Where a stage of ``size`` devices starts when ``next_free`` is the first free device:
    aligned to its size inside a host, to a host boundary for whole hosts."""
    align = size if size <= cluster.gpus_per_host else cluster.gpus_per_host
    return -(-next_free // align) * align


def stage_mesh(start: int, size: int) -> DeviceMesh:
    return DeviceMesh(list(range(start, start + size)), (TP_AXIS,))


@dataclass(frozen=True)
class Problem:
    """A checked partitioning problem, with the memos its costs fill."""

    layers: tuple[Layer, ...]
    cluster: Cluster
    num_microbatches: int
    memory_per_device: float | None = None
    strategy: str = "broadcast"
    _memo: dict[tuple, tuple[float, float]] = field(default_factory=dict, repr=False,
                                                     compare=False)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """The stage sizes worth searching: submesh sizes some layer supports."""
        wanted = {t for layer in self.layers for t in layer.degrees}
        return tuple(s for s in submesh_sizes(self.cluster) if s in wanted)

    @cached_property
    def split(self) -> bool:
        return all(layer.split for layer in self.layers)

    def stage_seconds(self, first: int, stop: int, size: int) -> float:
        """F + B of layers ``first..stop-1`` at TP degree ``size`` (inf if one lacks it)."""
        if any(size not in layer.forward for layer in self.layers[first:stop]):
            return math.inf
        return sum(layer.seconds(size) for layer in self.layers[first:stop])

    def stage_bytes(self, first: int, stop: int, size: int) -> tuple[float, float]:
        """Per device: (parameter bytes, activation bytes per microbatch kept)."""
        params = sum(layer.params_bytes for layer in self.layers[first:stop])
        acts = sum(layer.activation_bytes for layer in self.layers[first:stop])
        return params / size, acts / size

    def fits(self, first: int, stop: int, size: int, in_flight: int) -> bool:
        if self.memory_per_device is None:
            return True
        params, acts = self.stage_bytes(first, stop, size)
        return params + in_flight * acts <= self.memory_per_device

    def most_kept(self, first: int, stop: int, size: int) -> int:
        """The most microbatches (at most m) a stage may keep within memory (0: none)."""
        m = self.num_microbatches
        if self.memory_per_device is None:
            return m
        params, acts = self.stage_bytes(first, stop, size)
        if acts == 0:
            return m if params <= self.memory_per_device else 0
        c = max(0, min(m, math.floor((self.memory_per_device - params) / acts)))
        while c < m and self.fits(first, stop, size, c + 1):  # (rounding)
            c += 1
        while c > 0 and not self.fits(first, stop, size, c):
            c -= 1
        return c

    def boundary_seconds(self, cut: int, prev: tuple[int, int], here: tuple[int, int]
                         ) -> tuple[float, float]:
        """(activation, gradient) seconds across the cut before layer ``cut``, from the
        stage at ``prev`` = (first device, size) to the one at ``here`` — planned once per
        placement up to a shift by whole hosts (the cluster is homogeneous). The stage
        after may sit before it (the last chunk's rank handing to the first's)."""
        g = self.cluster.gpus_per_host
        base = min(prev[0], here[0]) // g * g
        out, into = self.layers[cut - 1], self.layers[cut]
        key = (out.output_shape, out.dtype, out.output_spec, into.input_spec,
               prev[0] - base, prev[1], here[0] - base, here[1])
        hit = self._memo.get(key)
        if hit is None:
            src = Sharding(stage_mesh(prev[0] - base, prev[1]), out.output_spec)
            dst = Sharding(stage_mesh(here[0] - base, here[1]), into.input_spec)
            options = PlanOptions(strategy=self.strategy, balance="size")
            hit = self._memo[key] = tuple(  # type: ignore[assignment]
                estimate(plan_resharding(out.output_shape, out.dtype, a, b, self.cluster,
                                         options), self.cluster)
                for a, b in ((src, dst), (dst, src)))
        return hit  # type: ignore[return-value]

    def estimate(self, stages: Sequence[Stage]) -> float:
        """The estimate E of a candidate (module doc); inf if a stage lacks its degree."""
        terms = [self.stage_seconds(a, b, size) for a, b, _, size in stages]
        comm = 0.0
        for prev, here in itertools.pairwise(stages):
            fwd, bwd = self.boundary_seconds(here[0], prev[2:], here[2:])
            terms += [fwd, bwd]
            comm += fwd + bwd
        return sum(terms[:len(stages)]) + comm + (self.num_microbatches - 1) * max(terms)

    def feasible(self, stages: Sequence[Stage]) -> bool:
        """Every stage fits its devices with 1F1B's activations (``min(m, p − s)``)."""
        p, m = len(stages), self.num_microbatches
        return all(self.fits(a, b, size, min(m, p - s))
                   for s, (a, b, _, size) in enumerate(stages))


__all__ = ["TP_AXIS", "Layer", "PartitionError", "Problem", "Stage", "all_reduce_seconds",
           "placed", "stage_mesh", "submesh_shape", "submesh_sizes"]
