"""The physical cluster: hosts, GPUs, NICs and the links between them.

Devices are global ints, host-major: ``device = host * gpus_per_host + local_index``.
With ``nics_per_host`` NICs, GPUs are attached to NICs in contiguous groups of
``gpus_per_host // nics_per_host`` (local GPU ``g`` uses local NIC ``g * nics_per_host //
gpus_per_host``), which is how DGX/HGX boards pair GPUs with NICs behind PCIe switches.

All bandwidths are in gigabits per second (Gbps, 10**9 bit/s) so that NIC and NVLink figures
compare directly; byte rates come from :meth:`Cluster.nic_bytes_per_s` and friends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, asdict, dataclass
from typing import Any

from .errors import ClusterError, check_positive_int


def _positive_float(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster.

    Args:
        num_hosts: number of hosts.
        gpus_per_host: GPUs per host.
        nic_gbps: bandwidth of one NIC, per direction (ingress and egress are separate).
        nics_per_host: NICs per host; must divide ``gpus_per_host``.
        nvlink_gbps: effective intra-host bandwidth of one GPU, per direction.
        nic_latency_us: one-way latency of a network hop (the α of the α–β model).
        nvlink_latency_us: latency of an intra-host hop.

    Everything after ``gpus_per_host`` is keyword-only. The NVLink and latency defaults are the
    p3.8xlarge figures (see :meth:`preset`).
    """

    num_hosts: int
    gpus_per_host: int
    _: KW_ONLY  # the link figures are always named: Cluster(2, 4, nic_gbps=10, ...)
    nic_gbps: float
    nics_per_host: int = 1
    nvlink_gbps: float = 640.0
    nic_latency_us: float = 40.0
    nvlink_latency_us: float = 5.0

    def __post_init__(self) -> None:
        check_positive_int("num_hosts", self.num_hosts)
        check_positive_int("gpus_per_host", self.gpus_per_host)
        check_positive_int("nics_per_host", self.nics_per_host)
        for name in ("nic_gbps", "nvlink_gbps"):
            object.__setattr__(self, name, _positive_float(name, getattr(self, name)))
        for name in ("nic_latency_us", "nvlink_latency_us"):
            object.__setattr__(
                self, name, _positive_float(name, getattr(self, name), allow_zero=True)
            )
        if self.gpus_per_host % self.nics_per_host:
            raise ValueError(
                f"nics_per_host={self.nics_per_host} must divide gpus_per_host="
                f"{self.gpus_per_host} (GPUs are attached to NICs in equal groups)"
            )

    # ---- presets -------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, num_hosts: int) -> Cluster:
        """A cluster of ``num_hosts`` copies of a known machine.

        ``"p3.8xlarge"`` — the paper's AWS cluster (arXiv 2211.05322, §6): 4 × V100-16GB per
        host; AWS lists the instance at "10 Gigabit" networking, one ENA NIC. The V100s are
        joined by NVLink 2 (hybrid cube mesh); we use 80 GB/s = 640 Gbps effective per GPU and
        direction, about what NCCL's all-gather bus bandwidth reaches on 4 V100s (nccl-tests).
        Network latency ≈ 40 µs is the order of TCP/ENA round trips measured on EC2 (NCCL over
        sockets); NVLink latency ≈ 5 µs is a small NCCL kernel launch plus hop.

        ``"dgx-h100"`` — NVIDIA DGX H100 (datasheet): 8 × H100 SXM, 8 × ConnectX-7 400 Gb/s
        InfiniBand NICs for the compute fabric, one per GPU; NVLink 4 gives 900 GB/s
        bidirectional per GPU, of which NCCL all-gather reaches about 370 GB/s per direction
        in practice (nccl-tests bus bandwidth) = 2960 Gbps. InfiniBand latency ≈ 5 µs,
        NVLink ≈ 3 µs.
        """
        try:
            params = _PRESETS[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown cluster preset {name!r}; known presets: {sorted(_PRESETS)}"
            ) from None
        return cls(num_hosts=num_hosts, **params)

    @classmethod
    def local(cls, num_devices: int) -> Cluster:
        """``num_devices`` virtual devices 0..n−1 on one host: what a run on this machine's
        CPU backend (or its GPUs) has, without naming a cloud machine. Its links are
        memory copies — 80 Gbps (10 GB/s) at 1 µs for the cost model; nothing crosses a
        network. Presets stay for planning clusters you do not have."""
        check_positive_int("num_devices", num_devices)
        return cls(1, num_devices, nic_gbps=80.0, nics_per_host=1, nvlink_gbps=80.0,
                   nic_latency_us=1.0, nvlink_latency_us=1.0)

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None, *, like: str = "dgx-h100"
               ) -> Cluster:
        """The devices this job really has (:mod:`scheduler.detect`): the visible GPUs of
        this host — at least one per process of the host — times the hosts the launcher
        (torchrun, Slurm, mpiexec) started the job on; with no GPU, one virtual device per
        process (the CPU backend's; ``Cluster.local(n)`` gives a process more). Links are
        not measured: GPUs get the link figures of preset ``like`` (NICs per host as there
        when they divide the GPUs, else one), CPU devices :meth:`local`'s."""
        import os

        from .detect import job_hosts, visible_gpus

        env = os.environ if env is None else env
        hosts, per_host = job_hosts(env)
        gpus = visible_gpus(env)
        if gpus == 0:
            local = cls.local(per_host)
            return cls(hosts, per_host, **{k: v for k, v in asdict(local).items()
                                          if k not in ("num_hosts", "gpus_per_host")})
        try:
            figures = dict(_PRESETS[like])
        except (KeyError, TypeError):
            raise ValueError(f"like: unknown cluster preset {like!r}; known presets: "
                             f"{sorted(_PRESETS)}") from None
        per_host = max(gpus, per_host)
        if per_host % figures["nics_per_host"]:
            figures["nics_per_host"] = 1
        figures["gpus_per_host"] = per_host
        return cls(num_hosts=hosts, **figures)

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """The names :meth:`preset` knows."""
        return tuple(sorted(_PRESETS))

    # ---- topology ------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        """Devices (GPUs) in the cluster: hosts × GPUs per host."""
        return self.num_hosts * self.gpus_per_host

    @property
    def num_nics(self) -> int:
        """NICs in the cluster: hosts × NICs per host."""
        return self.num_hosts * self.nics_per_host

    def check_device(self, device: int, *, argument: str = "device") -> int:
        """``device`` if it is a device id of this cluster; TypeError/ValueError naming ``argument``
        otherwise."""
        if isinstance(device, bool) or not isinstance(device, (int,)):
            raise TypeError(f"{argument}: device ids are ints, got {device!r}")
        if not 0 <= device < self.num_devices:
            raise ValueError(
                f"{argument}: device {device} is outside the cluster "
                f"({self.num_hosts} hosts × {self.gpus_per_host} GPUs = devices "
                f"0..{self.num_devices - 1})"
            )
        return device

    def host_of(self, device: int) -> int:
        """The host of a device (ids are host-major)."""
        return device // self.gpus_per_host

    def nic_of(self, device: int) -> int:
        """Global NIC id (host-major) that ``device`` uses for network traffic."""
        host, local = divmod(device, self.gpus_per_host)
        return host * self.nics_per_host + local * self.nics_per_host // self.gpus_per_host

    def host_of_nic(self, nic: int) -> int:
        """The host of a NIC (NIC ids are host-major)."""
        return nic // self.nics_per_host

    def devices_of_host(self, host: int) -> range:
        """The device ids of one host."""
        return range(host * self.gpus_per_host, (host + 1) * self.gpus_per_host)

    def mesh(self, hosts: Iterable[int], axis_names: tuple[str, str] = ("host", "gpu"), *,
             gpus: int | None = None):
        """A 2-d mesh over hosts: shape (len(hosts), gpus), the first ``gpus`` GPUs of each
        host (all of them by default)."""
        from .mesh import DeviceMesh

        hosts = list(hosts)
        for h in hosts:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < self.num_hosts:
                raise ValueError(
                    f"hosts: {h!r} is not a host of this {self.num_hosts}-host cluster"
                )
        g = self.gpus_per_host if gpus is None else gpus
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= self.gpus_per_host:
            raise ValueError(f"gpus: {g!r} GPUs per host; the cluster has {self.gpus_per_host}")
        return DeviceMesh([list(self.devices_of_host(h))[:g] for h in hosts], axis_names)

    # ---- rates ---------------------------------------------------------------------------

    @property
    def nic_bytes_per_s(self) -> float:
        """One NIC's bandwidth, bytes per second per direction."""
        return self.nic_gbps * 1e9 / 8

    @property
    def nvlink_bytes_per_s(self) -> float:
        """A GPU's NVLink bandwidth, bytes per second per direction."""
        return self.nvlink_gbps * 1e9 / 8

    @property
    def nic_latency_s(self) -> float:
        """A network hop's latency, seconds."""
        return self.nic_latency_us * 1e-6

    @property
    def nvlink_latency_s(self) -> float:
        """An NVLink hop's latency, seconds."""
        return self.nvlink_latency_us * 1e-6

    # ---- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The cluster's figures as a dict (what :meth:`from_dict` and case files read)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """A cluster from :meth:`to_dict`'s dict, or ``{"preset": name, "num_hosts": n}``."""
        if "preset" in data:
            extra = set(data) - {"preset", "num_hosts"}
            if extra:
                raise ValueError(
                    f"cluster: a preset takes only num_hosts, got also {sorted(extra)}"
                )
            return cls.preset(data["preset"], data["num_hosts"])
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"cluster: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


_PRESETS: dict[str, dict[str, Any]] = {
    "p3.8xlarge": dict(
        gpus_per_host=4,
        nic_gbps=10.0,
        nics_per_host=1,
        nvlink_gbps=640.0,
        nic_latency_us=40.0,
        nvlink_latency_us=5.0,
    ),
    "dgx-h100": dict(
        gpus_per_host=8,
        nic_gbps=400.0,
        nics_per_host=8,
        nvlink_gbps=2960.0,
        nic_latency_us=5.0,
        nvlink_latency_us=3.0,
    ),
}

__all__ = ["Cluster", "ClusterError"]
