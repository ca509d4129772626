"""Sharding specs (JAX PartitionSpec semantics) and shardings of a tensor over a mesh.

Split rule (uneven sizes): a dimension of size ``n`` split ``k`` ways uses ceil-division, as
``torch.chunk`` and DTensor's ``Shard`` do: every shard has ``c = ceil(n / k)`` elements except
the last non-empty one, and shards past the end are empty. Shard ``i`` is
``[min(i*c, n), min((i+1)*c, n))``. For n=10, k=4: sizes 3, 3, 3, 1; for n=5, k=4: 2, 2, 1, 0.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from .errors import ShardingError
from .mesh import DeviceMesh
from .regions import Region

SpecEntry = str | tuple[str, ...] | None


def _canonical_entry(entry: object, position: int) -> SpecEntry:
    if entry is None:
        return None
    if isinstance(entry, str):
        if not entry:
            raise TypeError(f"spec entry {position}: axis names are non-empty strings")
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        for n in names:
            if not isinstance(n, str) or not n:
                raise TypeError(
                    f"spec entry {position}: a tuple entry holds mesh axis names, got {n!r}"
                )
        if not names:
            return None
        return names[0] if len(names) == 1 else names
    raise TypeError(
        f"spec entry {position}: expected None, a mesh axis name or a tuple of names, "
        f"got {entry!r} ({type(entry).__name__})"
    )


def _entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry


class ShardingSpec:
    """How each tensor dimension is split over mesh axes, like ``jax.sharding.PartitionSpec``.

    ``ShardingSpec("host", None, ("host2", "gpu"))``: dim 0 split over axis "host", dim 1 not
    split, dim 2 split over the product of "host2" and "gpu" (major to minor). Axes not named
    are replicated. Fewer entries than the tensor rank leave the trailing dims unsplit.
    Immutable and hashable; single-name tuples are canonicalized to the name.
    """

    __slots__ = ("_entries", "_hash")

    def __init__(self, *entries: object) -> None:
        canon = tuple(_canonical_entry(e, i) for i, e in enumerate(entries))
        seen: dict[str, int] = {}
        for i, e in enumerate(canon):
            for name in _entry_axes(e):
                if name in seen:
                    raise ShardingError(
                        f"spec {self._fmt(canon)}: mesh axis {name!r} is used by dims "
                        f"{seen[name]} and {i}; each axis may split at most one dimension"
                    )
                seen[name] = i
        self._entries: tuple[SpecEntry, ...] = canon

    @staticmethod
    def _fmt(entries: tuple[SpecEntry, ...]) -> str:
        return "P(" + ", ".join(repr(e) for e in entries) + ")"

    @property
    def entries(self) -> tuple[SpecEntry, ...]:
        """One entry per split tensor dimension: None, an axis name, or a tuple of names."""
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __getitem__(self, i: int) -> SpecEntry:
        return self._entries[i]

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order."""
        return tuple(a for e in self._entries for a in _entry_axes(e))

    def padded(self, rank: int) -> tuple[SpecEntry, ...]:
        """The entries for a tensor of ``rank`` dimensions (trailing dims unsplit); ShardingError if
        the spec is longer than the rank."""
        if len(self._entries) > rank:
            raise ShardingError(
                f"spec {self!r} has {len(self._entries)} entries but the tensor has rank {rank}; "
                "hint: a spec may be shorter than the rank (trailing dims are not split), "
                "never longer"
            )
        return self._entries + (None,) * (rank - len(self._entries))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingSpec):
            return NotImplemented
        # Trailing Nones do not change the meaning, as in JAX.
        return _strip(self._entries) == _strip(other._entries)

    def __hash__(self) -> int:
        # Kept: layouts key the runtime's caches, looked up on every call (as JAX keeps a
        # sharding's hash).
        try:
            return self._hash
        except AttributeError:
            self._hash: int = hash(_strip(self._entries))
            return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardingSpec, self._entries)  # (rebuilt: see DeviceMesh.__reduce__)

    def __repr__(self) -> str:
        return self._fmt(self._entries)

    def to_json(self) -> list[Any]:
        """The entries as JSON-ready lists."""
        return [list(e) if isinstance(e, tuple) else e for e in self._entries]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> ShardingSpec:
        """A spec from :meth:`to_json`'s list."""
        if not isinstance(data, (list, tuple)):
            raise TypeError(f"spec: expected a list of entries, got {data!r}")
        return cls(*data)

    @classmethod
    def from_placements(
        cls, placements: Sequence[object], mesh: DeviceMesh
    ) -> ShardingSpec:
        """Convert PyTorch DTensor placements (one per mesh axis) to a spec.

        Accepts our :class:`Shard`/:class:`Replicate` or torch's own
        ``torch.distributed.tensor.Shard``/``Replicate`` (duck-typed: ``.dim`` / class name).
        Several mesh axes sharding one tensor dim are combined major to minor in mesh-axis
        order, which is DTensor's nesting; with uneven sizes DTensor chunks each level
        separately while we split the product once (identical when sizes divide).
        """
        if len(placements) != len(mesh.axis_names):
            raise ValueError(
                f"placements: need one placement per mesh axis {mesh.axis_names}, "
                f"got {len(placements)}: {list(placements)!r}"
            )
        by_dim: dict[int, list[str]] = {}
        for axis, p in zip(mesh.axis_names, placements):
            kind = type(p).__name__
            if kind == "Replicate":
                continue
            if kind == "Shard" and isinstance(getattr(p, "dim", None), int):
                if p.dim < 0:  # type: ignore[attr-defined]
                    raise ValueError(
                        f"placements: Shard({p.dim}) on axis {axis!r}: negative dims need the "  # type: ignore[attr-defined]
                        "tensor rank; normalize them first"
                    )
                by_dim.setdefault(p.dim, []).append(axis)  # type: ignore[attr-defined]
                continue
            raise TypeError(
                f"placements: axis {axis!r} has {p!r}; only Shard(dim) and Replicate() "
                "describe a resharding source/destination (Partial is a pending reduction)"
            )
        rank = max(by_dim, default=-1) + 1
        return cls(*(tuple(by_dim[d]) if d in by_dim else None for d in range(rank)))

    def to_placements(self, mesh: DeviceMesh) -> tuple[Shard | Replicate, ...]:
        """The DTensor-style placements of this spec, one per mesh axis.

        DTensor nests the shards of one dim in mesh-axis order, so a tuple entry whose axes
        run against the mesh order (``("gpu", "host")`` on a ("host", "gpu") mesh) has no
        placement form and raises ``ShardingError``.
        """
        where = {a: d for d, e in enumerate(self._entries) for a in _entry_axes(e)}
        for a in where:
            mesh.axis_index(a)
        for d, e in enumerate(self._entries):
            order = [mesh.axis_index(a) for a in _entry_axes(e)]
            if order != sorted(order):
                raise ShardingError(
                    f"spec {self!r}: dim {d} is split over {e} major to minor, against the mesh "
                    f"axis order {mesh.axis_names}; DTensor placements nest in mesh-axis order "
                    "and cannot express it"
                )
        return tuple(Shard(where[a]) if a in where else Replicate() for a in mesh.axis_names)


def _strip(entries: tuple[SpecEntry, ...]) -> tuple[SpecEntry, ...]:
    end = len(entries)
    while end and entries[end - 1] is None:
        end -= 1
    return entries[:end]


@dataclass(frozen=True)
class Shard:
    """DTensor-style placement: this mesh axis splits tensor dim ``dim``."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """DTensor-style placement: the tensor is replicated along this mesh axis."""


def split_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """Shard ``i`` of ``k`` of a dim of size ``n`` (ceil-division rule, see module doc)."""
    c = -(-n // k) if n else 0
    return min(i * c, n), min((i + 1) * c, n)


def check_shape(shape: Iterable[Any], *, argument: str = "shape") -> tuple[int, ...]:
    # A sequence, not any iterable: an iterator would be used up (and read as ()), a dict
    # or a set would give its keys in some order.
    if isinstance(shape, (str, bytes, Mapping, AbstractSet)) or (not isinstance(
            shape, Sequence) and not hasattr(shape, "__array__")):
        raise TypeError(f"{argument}: expected a sequence of ints (a tuple or list), got "
                        f"{type(shape).__name__} {shape!r}")
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{argument}: expected a sequence of ints, got {shape!r}") from None
    out = []
    for i, d in enumerate(dims):
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise TypeError(f"{argument}[{i}]: dims are ints, got {d!r}")
        d = int(d)
        if d < 0:
            raise ValueError(f"{argument}[{i}] = {d}: dims must be >= 0")
        out.append(d)
    return tuple(out)


class Sharding:
    """A tensor layout: ``spec`` applied to ``mesh`` (like ``jax.sharding.NamedSharding``)."""

    __slots__ = ("_hash", "_mesh", "_spec")

    def __init__(self, mesh: DeviceMesh, spec: ShardingSpec | Sequence[object]) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh: expected a DeviceMesh, got {type(mesh).__name__}")
        if not isinstance(spec, ShardingSpec):
            if isinstance(spec, (list, tuple)):
                spec = ShardingSpec(*spec)
            else:
                raise TypeError(f"spec: expected a ShardingSpec, got {spec!r}")
        for a in spec.axes():
            if a not in mesh.axis_names:
                raise ShardingError(
                    f"spec {spec!r} names axis {a!r}, but the mesh has axes {mesh.axis_names}"
                )
        self._mesh = mesh
        self._spec = spec

    @property
    def mesh(self) -> DeviceMesh:
        """The devices that hold the tensor."""
        return self._mesh

    @property
    def spec(self) -> ShardingSpec:
        """Which mesh axes split which tensor dimension."""
        return self._spec

    def num_shards(self, rank: int) -> tuple[int, ...]:
        """How many ways each of ``rank`` dims is split."""
        sizes = self._mesh.axis_sizes
        out = []
        for e in self._spec.padded(rank):
            k = 1
            for a in _entry_axes(e):
                k *= sizes[a]
            out.append(k)
        return tuple(out)

    def device_regions(self, shape: Sequence[int]) -> dict[int, Region]:
        """Device id -> the half-open box of the global tensor that device holds (a new
        dict each call; computed once per shape)."""
        return dict(_regions(self, check_shape(shape)))

    def _compute_regions(self, shape: tuple[int, ...]) -> dict[int, Region]:
        entries = self._spec.padded(len(shape))
        sizes = self._mesh.axis_sizes
        axis_pos = {a: i for i, a in enumerate(self._mesh.axis_names)}
        out: dict[int, Region] = {}
        for dev, coord in self._mesh.coords().items():
            region = []
            for n, e in zip(shape, entries):
                k, idx = 1, 0
                for a in _entry_axes(e):  # major to minor
                    idx = idx * sizes[a] + coord[axis_pos[a]]
                    k *= sizes[a]
                region.append(split_bounds(n, k, idx))
            out[dev] = tuple(region)
        return out

    def to_json(self) -> dict[str, Any]:
        """``{"mesh": ..., "spec": ...}``, JSON-ready."""
        return {"mesh": self._mesh.to_dict(), "spec": self._spec.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sharding:
        """A layout from :meth:`to_json`'s dict."""
        return cls(DeviceMesh.from_dict(data["mesh"]), ShardingSpec.from_json(data["spec"]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sharding):
            return NotImplemented
        return self._mesh == other._mesh and self._spec == other._spec

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash: int = hash((self._mesh, self._spec))  # (kept: see ShardingSpec)
            return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sharding, (self._mesh, self._spec))  # (rebuilt: see DeviceMesh.__reduce__)

    def __repr__(self) -> str:
        return f"Sharding({self._mesh!r}, {self._spec!r})"


P = ShardingSpec


# A runtime asks for the same layout's regions several times per call (checks, launch), every
# call: kept for recent (sharding, shape) pairs. lru_cache is thread-safe; callers get copies.
@functools.lru_cache(maxsize=256)
def _regions(sharding: Sharding, shape: tuple[int, ...]) -> dict[int, Region]:
    return sharding._compute_regions(shape)
