"""Device meshes: an n-d grid of global device ids with one name per axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ShardingError

_MAX_ID = 2**63 - 1  # ids are kept as int64


class DeviceMesh:
    """An immutable n-d array of device ids with named axes.

    ``DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("host", "gpu"))`` is two hosts of four GPUs.
    Planning never needs a live device: a mesh is only ids. Hashable and comparable by value.
    """

    __slots__ = ("_axis_names", "_devices", "_hash", "_ids")

    def __init__(self, devices: Any, axis_names: Sequence[str]) -> None:
        try:
            arr = np.array(devices, dtype=object)
        except Exception as exc:  # ragged input, etc.
            raise TypeError(f"devices: cannot read {devices!r} as an n-d array: {exc}") from None
        if arr.ndim == 0:
            raise ValueError(f"devices: need at least a 1-d array of device ids, got {devices!r}")
        if arr.size == 0:
            raise ValueError("devices: a mesh needs at least one device")
        for d in arr.flat:
            if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
                raise TypeError(f"devices: device ids are ints, got {d!r}")
            if not 0 <= d <= _MAX_ID:
                raise ValueError(f"devices: device ids are in 0..{_MAX_ID}, got {d}")
        ints = arr.astype(np.int64)
        flat = ints.ravel().tolist()
        if len(set(flat)) != len(flat):
            seen: set[int] = set()
            dup = next(d for d in flat if d in seen or seen.add(d))  # type: ignore[func-returns-value]
            raise ValueError(f"devices: device {dup} appears more than once in the mesh")
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        names = tuple(axis_names)
        for n in names:
            if not isinstance(n, str) or not n:
                raise TypeError(f"axis_names: each axis name is a non-empty str, got {n!r}")
        if len(names) != ints.ndim:
            raise ValueError(
                f"axis_names: {len(names)} names {names} for a {ints.ndim}-d mesh of shape "
                f"{ints.shape}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"axis_names: repeated axis name in {names}")
        ints.setflags(write=False)
        self._devices = ints
        self._axis_names = names
        self._ids = tuple(flat)  # (asked for on every runtime call)
        self._hash = hash((names, ints.shape, self._ids))

    @property
    def devices(self) -> np.ndarray:
        """The (read-only) n-d array of device ids."""
        return self._devices

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axis names, one per dimension."""
        return self._axis_names

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's size along each axis."""
        return tuple(int(s) for s in self._devices.shape)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Axis name -> its size."""
        return dict(zip(self._axis_names, self.shape))

    @property
    def size(self) -> int:
        """The number of devices in the mesh."""
        return int(self._devices.size)

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The mesh's device ids, in row-major order."""
        return self._ids

    def axis_index(self, name: str) -> int:
        """The dimension of axis ``name``; ShardingError if the mesh has no such axis."""
        try:
            return self._axis_names.index(name)
        except ValueError:
            raise ShardingError(
                f"unknown mesh axis {name!r}; this mesh has axes {self._axis_names}"
            ) from None

    def coords(self) -> dict[int, tuple[int, ...]]:
        """Device id -> its index along every mesh axis."""
        return {int(self._devices[idx]): idx for idx in np.ndindex(*self._devices.shape)}

    def to_dict(self) -> dict[str, Any]:
        """``{"devices": nested lists of ids, "axis_names": [...]}``."""
        return {"devices": self._devices.tolist(), "axis_names": list(self._axis_names)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceMesh:
        """A mesh from :meth:`to_dict`'s dict."""
        return cls(data["devices"], tuple(data["axis_names"]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self._axis_names == other._axis_names and np.array_equal(
            self._devices, other._devices
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt, not restored: a hash kept in a pickle is stale in a process whose string
        # hashing differs (PYTHONHASHSEED), and dict lookups there would miss.
        return (DeviceMesh, (self._devices, self._axis_names))

    def __repr__(self) -> str:
        shape = ", ".join(f"{n}={s}" for n, s in zip(self._axis_names, self.shape))
        lo, hi = int(self._devices.min()), int(self._devices.max())
        contiguous = hi - lo + 1 == self.size and np.array_equal(
            self._devices.ravel(), np.arange(lo, hi + 1)
        )
        where = f"devices {lo}..{hi}" if contiguous else f"devices {self._devices.tolist()}"
        return f"DeviceMesh({shape}; {where})"
