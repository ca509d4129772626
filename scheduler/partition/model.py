"""What :func:`scheduler.partition` searches over, and how it costs a candidate.

A model is a chain of :class:`Layer` s. A **stage** is a contiguous range of layers run on a
**submesh** of the cluster of ``n = dp × tp`` devices: tensor-parallel of degree ``tp`` (one
of the degrees its layers give times for) and data-parallel of degree ``dp`` — its mesh is
``dp × tp`` over axes ``("dp", "tp")``, each line along ``"dp"`` running the stage on
``1/dp`` of every microbatch's batch (dim 0), so its seconds are the layers' at ``tp``
divided by ``dp`` (the model's assumption: the layers' time scales with the batch), and its
parameter gradients are all-reduced over each ``"dp"`` line after its last backward. A stage
of ``dp = 1`` keeps the 1-d mesh over ``"tp"``. Submeshes are Alpa's shapes: ``1 × g``
inside one host for every ``g`` dividing the GPUs per host, and ``h × G`` whole hosts.
Stages are laid out in pipeline order on the host-major device list: each starts at the next
free device aligned to its size (``g`` inside a host, a host boundary for whole hosts) — so
a submesh never straddles hosts, and devices left over stay idle.

The **estimate** of a candidate (what the search minimises) is the pipeline's fill and drain
plus ``m − 1`` periods of its slowest term, with every boundary's transfers on the critical
path once each way:

    E = Σ_s (F_s + B_s) + Σ_b (x_b→ + x_b←) + (m − 1) · max(max_s (F_s + B_s), max_b x_b→,
                                                           max_b x_b←)

``F_s``, ``B_s``: the stage's layers' seconds at its TP degree divided by its DP degree;
``x_b→``, ``x_b←``: the cost model's estimate (:func:`scheduler.estimate`) of boundary
``b``'s activation and gradient resharding, planned with the search's strategy and the cheap
``size`` balance. With free transfers and a backward proportional to the forward it is
exactly GPipe's iteration time in the simulator, and no less than 1F1B's
(``tests/test_partition.py`` checks both). A data-parallel stage adds its gradient reduction
``R_s`` (the cost model's ring all-reduce of its parameter bytes / ``tp`` over one ``"dp"``
line, :meth:`CostModel.all_reduce_cost`) to E once: ``E_dp = E + Σ_s R_s``. Conservative on
purpose — the reduction of stage 0 starts after the step's last backward and is exposed in
full, the later stages' overlap the backwards of the stages before them, and the sum also
stands for their maximum — and a per-stage term keeps E a sum plus a maximum, which the
search needs. The finalists are then simulated for real (the reductions as the step graph's
ops). A stage fits its devices when its parameters and the activations of the microbatches
1F1B keeps there (``min(m, p − s)``) fit ``memory_per_device``: parameters divided by ``tp``
(replicated over ``dp``), activations by ``tp · dp`` (each device keeps its part of the
batch).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import Any

from ..cluster import Cluster
from ..cost import CostModel, estimate
from ..dtypes import check_dtype
from ..errors import check_positive_int
from ..mesh import DeviceMesh
from ..planner import PlanOptions, check_nbytes, plan_resharding
from ..sharding import Sharding, ShardingSpec, check_shape

TP_AXIS = "tp"  # the mesh axis of a stage's submesh whose devices split its layers
DP_AXIS = "dp"  # the mesh axis whose devices split the batch (a stage of DP degree > 1)
Stage = tuple[int, int, int, int, int]  # (first layer, stop layer, first device, size, dp)


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
    from ..cost import lower_bound_for

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


def stage_mesh(start: int, size: int, dp: int = 1) -> DeviceMesh:
    """A stage's mesh: 1-d over ``"tp"`` at DP degree 1, else ``dp × tp`` over ``("dp",
    "tp")`` with the TP devices contiguous (the tensor-parallel collectives run every layer,
    so they get the closest devices)."""
    if dp == 1:
        return DeviceMesh(list(range(start, start + size)), (TP_AXIS,))
    tp = size // dp
    return DeviceMesh([list(range(start + i * tp, start + (i + 1) * tp)) for i in range(dp)],
                      (DP_AXIS, TP_AXIS))


def with_dp(spec: ShardingSpec, shape: tuple[int, ...], dp: int) -> ShardingSpec | None:
    """A layer's TP layout on a stage of DP degree ``dp``: ``"dp"`` on dim 0 (the batch)
    composed with ``spec`` on the other dims; None when that is impossible — dim 0 does not
    divide by ``dp`` or ``spec`` already splits it."""
    if dp == 1:
        return spec
    entries = spec.padded(len(shape))
    if not shape or shape[0] % dp or entries[0] is not None:
        return None
    rest = list(entries[1:])
    while rest and rest[-1] is None:  # (trailing dims unsplit: the shorter spec)
        rest.pop()
    return ShardingSpec(DP_AXIS, *rest)


def dp_allowed(layer: Layer, dp: int) -> bool:
    """Whether ``layer`` can run in a stage of DP degree ``dp``: its output's batch divides
    by ``dp`` and neither of its layouts splits dim 0 already."""
    if dp == 1:
        return True
    free = all(len(spec) == 0 or spec[0] is None for spec in (layer.output_spec,
                                                              layer.input_spec))
    return free and with_dp(layer.output_spec, layer.output_shape, dp) is not None


def grad_bytes(params_bytes: float, tp: int) -> int:
    """Bytes per device a stage's gradient reduction all-reduces: its parameter bytes over
    its TP degree, rounded up (``DataParallel.nbytes`` is an int)."""
    return math.ceil(params_bytes / tp)


def reduce_line(start: int, size: int, dp: int) -> tuple[int, ...]:
    """The first line along ``"dp"`` of :func:`stage_mesh` ``(start, size, dp)``."""
    return tuple(start + i * (size // dp) for i in range(dp))


@dataclass(frozen=True)
class Problem:
    """A checked partitioning problem, with the memos its costs fill."""

    layers: tuple[Layer, ...]
    cluster: Cluster
    num_microbatches: int
    memory_per_device: float | None = None
    strategy: str = "broadcast"
    data_parallel: bool = True  # False: every stage DP degree 1 (tensor-parallel only)
    _memo: dict[tuple, tuple[float, float]] = field(default_factory=dict, repr=False,
                                                     compare=False)
    _ring: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict,
                                                              repr=False, compare=False)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """The stage sizes worth searching: submesh sizes some layer supports."""
        wanted = {t for layer in self.layers for t in layer.degrees}
        return tuple(s for s in submesh_sizes(self.cluster) if s in wanted)

    @cached_property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The stage shapes worth searching, (size, DP degree): every factorisation of a
        submesh size into ``dp × tp`` with ``tp`` a degree some layer supports (DP degree 1
        only when ``data_parallel`` is off), by size then DP degree."""
        wanted = {t for layer in self.layers for t in layer.degrees}
        return tuple((n, k) for n in submesh_sizes(self.cluster) for k in range(1, n + 1)
                     if n % k == 0 and n // k in wanted and (k == 1 or self.data_parallel))

    @cached_property
    def split(self) -> bool:
        return all(layer.split for layer in self.layers)

    def stage_seconds(self, first: int, stop: int, size: int, dp: int = 1) -> float:
        """F + B of layers ``first..stop-1`` on ``size`` devices at DP degree ``dp``: their
        seconds at TP degree ``size / dp`` over ``dp`` (inf if one lacks that degree or
        cannot run data-parallel, :func:`dp_allowed`)."""
        tp, part = size // dp, self.layers[first:stop]
        if any(tp not in layer.forward or not dp_allowed(layer, dp) for layer in part):
            return math.inf
        return sum(layer.seconds(tp) for layer in part) / dp

    def stage_bytes(self, first: int, stop: int, size: int, dp: int = 1
                    ) -> tuple[float, float]:
        """Per device: (parameter bytes, activation bytes per microbatch kept) — parameters
        split over the TP degree only (every DP line holds them all), activations over the
        whole submesh (each device keeps its part of the batch)."""
        params = sum(layer.params_bytes for layer in self.layers[first:stop])
        acts = sum(layer.activation_bytes for layer in self.layers[first:stop])
        return params / (size // dp), acts / size

    def fits(self, first: int, stop: int, size: int, in_flight: int, dp: int = 1) -> bool:
        if self.memory_per_device is None:
            return True
        params, acts = self.stage_bytes(first, stop, size, dp)
        return params + in_flight * acts <= self.memory_per_device

    def most_kept(self, first: int, stop: int, size: int, dp: int = 1) -> int:
        """The most microbatches (at most m) a stage may keep within memory (0: none)."""
        m = self.num_microbatches
        if self.memory_per_device is None:
            return m
        params, acts = self.stage_bytes(first, stop, size, dp)
        if acts == 0:
            return m if params <= self.memory_per_device else 0
        c = max(0, min(m, math.floor((self.memory_per_device - params) / acts)))
        while c < m and self.fits(first, stop, size, c + 1, dp):  # (rounding)
            c += 1
        while c > 0 and not self.fits(first, stop, size, c, dp):
            c -= 1
        return c

    def ring(self, size: int, dp: int) -> tuple[float, float]:
        """(fixed seconds, bandwidth) of a gradient reduction over one ``"dp"`` line of a
        stage of ``size`` devices — the same wherever the stage sits (a submesh is inside one
        host or whole hosts, and the cluster is homogeneous), so it is costed at device 0."""
        hit = self._ring.get((size, dp))
        if hit is None:
            tc = CostModel(self.cluster).all_reduce_cost(reduce_line(0, size, dp), 1 << 20)
            hit = self._ring[(size, dp)] = (tc.fixed_s, tc.alone_bw)
        return hit

    def reduce_seconds(self, params_bytes: float, size: int, dp: int) -> float:
        """R: the ring all-reduce of a stage's gradients (``params_bytes`` of its layers in
        all, :func:`grad_bytes` per device) over a ``"dp"`` line, as the cost model prices
        it (:meth:`CostModel.all_reduce_cost`: fixed seconds plus the bytes each device
        sends over the slowest hop's bandwidth); 0 at DP degree 1."""
        if dp == 1:
            return 0.0
        fixed, bw = self.ring(size, dp)
        return fixed + 2 * (dp - 1) * grad_bytes(params_bytes, size // dp) // dp / bw

    def stage_reduce(self, first: int, stop: int, size: int, dp: int) -> float:
        """R of layers ``first..stop-1`` as one stage (:meth:`reduce_seconds`)."""
        params = sum(layer.params_bytes for layer in self.layers[first:stop])
        return self.reduce_seconds(params, size, dp)

    def boundary_seconds(self, cut: int, prev: tuple[int, ...], here: tuple[int, ...]
                         ) -> tuple[float, float]:
        """(activation, gradient) seconds across the cut before layer ``cut``, from the
        stage at ``prev`` = (first device, size[, DP degree]) to the one at ``here`` —
        planned once per placement up to a shift by whole hosts (the cluster is
        homogeneous); inf both ways when a side's DP degree cannot split the tensor's batch
        (:func:`with_dp`). The stage after may sit before it (the last chunk's rank handing
        to the first's)."""
        g = self.cluster.gpus_per_host
        base = min(prev[0], here[0]) // g * g
        out, into = self.layers[cut - 1], self.layers[cut]
        pdp, hdp = (prev[2] if len(prev) > 2 else 1), (here[2] if len(here) > 2 else 1)
        key = (out.output_shape, out.dtype, out.output_spec, into.input_spec,
               prev[0] - base, prev[1], pdp, here[0] - base, here[1], hdp)
        hit = self._memo.get(key)
        if hit is None:
            specs = (with_dp(out.output_spec, out.output_shape, pdp),
                     with_dp(into.input_spec, out.output_shape, hdp))
            if specs[0] is None or specs[1] is None:
                hit = self._memo[key] = (math.inf, math.inf)
                return hit
            src = Sharding(stage_mesh(prev[0] - base, prev[1], pdp), specs[0])
            dst = Sharding(stage_mesh(here[0] - base, here[1], hdp), specs[1])
            options = PlanOptions(strategy=self.strategy, balance="size")
            hit = self._memo[key] = tuple(  # type: ignore[assignment]
                estimate(plan_resharding(out.output_shape, out.dtype, a, b, self.cluster,
                                         options), self.cluster)
                for a, b in ((src, dst), (dst, src)))
        return hit  # type: ignore[return-value]

    def estimate(self, stages: Sequence[Stage]) -> float:
        """The estimate E (E_dp with data-parallel stages) of a candidate (module doc); inf
        if a stage lacks its degree."""
        terms = [self.stage_seconds(a, b, size, dp) for a, b, _, size, dp in stages]
        reduce = sum(self.stage_reduce(a, b, size, dp) for a, b, _, size, dp in stages)
        comm = 0.0
        for prev, here in itertools.pairwise(stages):
            fwd, bwd = self.boundary_seconds(here[0], prev[2:], here[2:])
            terms += [fwd, bwd]
            comm += fwd + bwd
        return (sum(terms[:len(stages)]) + comm + reduce
                + (self.num_microbatches - 1) * max(terms))

    def feasible(self, stages: Sequence[Stage]) -> bool:
        """Every stage fits its devices with 1F1B's activations (``min(m, p − s)``)."""
        p, m = len(stages), self.num_microbatches
        return all(self.fits(a, b, size, min(m, p - s), dp)
                   for s, (a, b, _, size, dp) in enumerate(stages))


__all__ = ["DP_AXIS", "TP_AXIS", "Layer", "PartitionError", "Problem", "Stage",
           "all_reduce_seconds", "dp_allowed", "grad_bytes", "placed", "reduce_line",
           "stage_mesh", "submesh_shape", "submesh_sizes", "with_dp"]
