"""The values :func:`scheduler.partition` returns: each stage's layers, submesh, TP and DP
degrees,
the boundaries between them, the schedule and what the simulator says of it — and their JSON,
which ``overlap simulate --case`` reads as a pipeline case and :meth:`PartitionPlan.from_json`
reads back for :meth:`~PartitionPlan.lower` (the step graph the runtime runs)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..cluster import Cluster
from ..errors import load_json
from ..graph import DataParallel, StepGraph
from ..lowering import Boundary, lower
from ..mesh import DeviceMesh
from ..plan import fmt_bytes
from ..planner import PlanOptions
from ..schedules import Schedule
from ..sharding import Sharding, ShardingSpec
from ..simulator import simulate
from ..timeline import Timeline


@dataclass(frozen=True)
class StagePlan:
    """One stage: ``layers`` (a range of the model's layers), its submesh (``mesh``: 1-d
    over axis ``"tp"`` when ``dp`` is 1, else ``dp × tp`` over ``("dp", "tp")``;
    ``submesh``: its shape as hosts × GPUs per host), its TP degree ``tp`` and DP degree
    ``dp`` (``tp · dp`` is the mesh's size) and its seconds per microbatch on each of its
    devices (its part of the batch; ``input_grad`` and ``weight_grad`` None unless every
    layer splits its backward); ``params_bytes`` and ``activation_bytes`` per device
    (activations: per microbatch kept). A stage of ``dp`` > 1 all-reduces its gradients,
    ``params_bytes`` per device, over each ``"dp"`` line after its last backward."""

    layers: range
    mesh: DeviceMesh
    tp: int
    submesh: tuple[int, int]
    forward: float
    backward: float
    input_grad: float | None
    weight_grad: float | None
    params_bytes: float
    activation_bytes: float
    dp: int = 1


@dataclass(frozen=True)
class PartitionPlan:
    """A pipeline chosen by :func:`scheduler.partition` (see its doc).

    ``iteration_time``, ``bubble`` and ``exposed_comm`` (the timeline's ``bubble_fraction``
    and ``exposed_comm_fraction``) are the simulator's for ``schedule`` on these
    stages and ``boundaries`` (planned with ``options``); ``peak_memory[s]`` is bytes per
    device of stage ``s``'s mesh under that schedule (parameters plus the activations it
    keeps, of every stage on that mesh when a schedule runs two chunks per rank);
    ``estimate`` the search's closed form (E, or E₂ for two chunks per rank); ``search``
    what the search and the ranking did (runs, cells, gap, every simulated finalist)."""

    stages: tuple[StagePlan, ...]
    boundaries: tuple[Boundary, ...]
    schedule: Schedule
    cluster: Cluster
    num_microbatches: int
    iteration_time: float
    bubble: float
    exposed_comm: float
    peak_memory: tuple[float, ...]
    estimate: float
    options: PlanOptions = field(default_factory=PlanOptions)
    search: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def meshes(self) -> tuple[DeviceMesh, ...]:
        """Each stage's submesh, in pipeline order (what :class:`TorchPipeline` takes)."""
        return tuple(s.mesh for s in self.stages)

    def compute_costs(self) -> dict[tuple[int, str], float]:
        """Seconds per (stage, kind) — what :func:`scheduler.simulate` takes."""
        out: dict[tuple[int, str], float] = {}
        for s, st in enumerate(self.stages):
            out[(s, "F")], out[(s, "B")] = st.forward, st.backward
            if st.input_grad is not None and st.weight_grad is not None:
                out[(s, "I")], out[(s, "W")] = st.input_grad, st.weight_grad
        return out

    @property
    def data_parallel(self) -> dict[int, DataParallel]:
        """The stages of DP degree > 1 and their gradient reductions (what :func:`scheduler.
        lower` takes as ``data_parallel``): over axis ``"dp"``, ``params_bytes`` per device
        rounded up."""
        return {s: DataParallel("dp", math.ceil(st.params_bytes))
                for s, st in enumerate(self.stages) if st.dp > 1}

    def lower(self, options: PlanOptions | None = None) -> StepGraph:
        """The step graph of this pipeline — what ``simulate`` and the runtime's
        ``train_step(..., graph=)`` take (``options``: this plan's by default), with a
        gradient reduction per ``"dp"`` line of each data-parallel stage."""
        return lower(self.meshes, self.boundaries, self.schedule, self.cluster,
                     options or self.options, data_parallel=self.data_parallel)

    def simulate(self) -> Timeline:
        """The plan's step simulated: :func:`scheduler.simulate` of :meth:`lower`."""
        return simulate(self.lower(), self.cluster, self.compute_costs())

    # ---- text and JSON -------------------------------------------------------------------

    def to_text(self) -> str:
        """The plan as a table: stages, layers, mesh, TP and DP degrees, boundary layouts,
        seconds, memory."""
        head = ["stage", "layers", "mesh", "devices", "TP", "DP", "receives", "sends", "F ms",
                "B ms", "memory/device"]
        rows = [head]
        for s, st in enumerate(self.stages):
            recv = "-" if s == 0 else repr(self.boundaries[s - 1].consumer.spec)
            send = "-" if s == len(self.stages) - 1 else repr(self.boundaries[s].producer.spec)
            ids = st.mesh.device_ids
            rows.append([str(s), f"{st.layers.start}-{st.layers.stop - 1}",
                         f"{st.submesh[0]}x{st.submesh[1]}", f"{ids[0]}-{ids[-1]}",
                         str(st.tp), str(st.dp), recv, send, f"{st.forward * 1e3:.2f}",
                         f"{st.backward * 1e3:.2f}", fmt_bytes(int(self.peak_memory[s]))])
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]
        lines.append(f"schedule {self.schedule.name}, {self.num_microbatches} microbatches: "
                     f"simulated iteration {self.iteration_time * 1e3:.2f} ms, bubble "
                     f"{self.bubble:.1%}, exposed communication {self.exposed_comm:.1%} "
                     f"(estimate {self.estimate * 1e3:.2f} ms)")
        return "\n".join(lines)

    def to_json(self) -> str:
        """A pipeline case ``overlap simulate --case`` reads (cluster, stages, boundaries,
        microbatches, compute_ms), with the schedule and the partition's own fields."""
        return json.dumps({
            "cluster": self.cluster.to_dict(),
            "stages": [m.to_dict() for m in self.meshes],
            "boundaries": [{"shape": list(b.shape), "dtype": b.dtype,
                            "producer": b.producer.spec.to_json(),
                            "consumer": b.consumer.spec.to_json()} for b in self.boundaries],
            "microbatches": self.num_microbatches,
            "compute_ms": [{k: v * 1e3 for (s2, k), v in self.compute_costs().items()
                            if s2 == s} for s in range(len(self.stages))],
            "schedule": json.loads(self.schedule.to_json()),
            "data_parallel": {str(s): {"axis": dp.axis, "nbytes": dp.nbytes}
                              for s, dp in sorted(self.data_parallel.items())},
            "plan_options": {"strategy": self.options.strategy, "balance": self.options.balance,
                             "seed": self.options.seed, "budget": self.options.budget},
            "partition": {
                "layers": [[st.layers.start, st.layers.stop] for st in self.stages],
                "tp": [st.tp for st in self.stages],
                "dp": [st.dp for st in self.stages],
                "submesh": [list(st.submesh) for st in self.stages],
                "bytes_per_device": [[st.params_bytes, st.activation_bytes]
                                     for st in self.stages],
                "iteration_ms": self.iteration_time * 1e3, "bubble": self.bubble,
                "exposed_comm": self.exposed_comm, "peak_memory": list(self.peak_memory),
                "estimate_ms": self.estimate * 1e3,
            },
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> PartitionPlan:
        """The plan :meth:`to_json` wrote (ValueError naming what is malformed)."""
        return load_json(text, "partition plan JSON", _from_data)


def _from_data(data: dict[str, Any]) -> PartitionPlan:
    cluster = Cluster.from_dict(data["cluster"])
    meshes = [DeviceMesh.from_dict(m) for m in data["stages"]]
    part = data["partition"]
    costs = data["compute_ms"]
    if not (len(costs) == len(part["layers"]) == len(meshes) == len(data["boundaries"]) + 1):
        raise ValueError("stages, compute_ms, partition.layers and boundaries disagree on "
                         "the number of stages")
    dps = part.get("dp", [1] * len(meshes))  # (plans written before the DP axis: all 1)
    if len(dps) != len(meshes):
        raise ValueError("partition.dp: one DP degree per stage expected")
    stages = []
    for s, mesh in enumerate(meshes):
        c = costs[s]
        split = "I" in c and "W" in c
        params, acts = part["bytes_per_device"][s]
        stages.append(StagePlan(
            range(*part["layers"][s]), mesh, int(part["tp"][s]), tuple(part["submesh"][s]),
            c["F"] / 1e3, c["B"] / 1e3, c["I"] / 1e3 if split else None,
            c["W"] / 1e3 if split else None, float(params), float(acts), int(dps[s])))
    boundaries = tuple(
        Boundary(tuple(b["shape"]), str(b["dtype"]),
                 Sharding(meshes[s], ShardingSpec.from_json(b["producer"])),
                 Sharding(meshes[s + 1], ShardingSpec.from_json(b["consumer"])))
        for s, b in enumerate(data["boundaries"]))
    return PartitionPlan(
        tuple(stages), boundaries, Schedule.from_json(json.dumps(data["schedule"])), cluster,
        int(data["microbatches"]), part["iteration_ms"] / 1e3, float(part["bubble"]),
        float(part["exposed_comm"]), tuple(float(x) for x in part["peak_memory"]),
        part["estimate_ms"] / 1e3, PlanOptions(**data["plan_options"]))


__all__ = ["PartitionPlan", "StagePlan"]
