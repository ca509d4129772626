"""Element types a plan, a boundary or a step may carry: numpy's numeric types and bool, and
the narrow floating types training uses that numpy lacks — bfloat16 and the float8 kinds —
through ``ml_dtypes`` (JAX's numpy extension types: real numpy dtypes, 2 or 1 bytes per
element, with arithmetic). Importing this module registers their names with numpy, so
``np.dtype("bfloat16")`` works everywhere (plans read back from JSON included)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

NUMERIC_KINDS = "biufc"  # bool, signed and unsigned integers, floating point, complex

# ml_dtypes' floating types that torch has too (torch.bfloat16, torch.float8_*).
NARROW_FLOATS: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz")
}


def check_dtype(dtype: object, argument: str = "dtype") -> np.dtype:
    """``dtype`` as a canonical numpy dtype ('<f4' and '=f4' are 'float32'): a numeric or
    bool dtype in this machine's byte order, or one of :data:`NARROW_FLOATS`; else a
    TypeError naming ``argument``."""
    if dtype is None:  # (numpy reads None as float64: a plan's dtype is named explicitly)
        raise TypeError(f"{argument}: None; name the dtype ('float32', 'bfloat16', ...)")
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{argument}: {dtype!r} is not a numpy dtype or dtype name") from None
    if dt.name in NARROW_FLOATS and dt == NARROW_FLOATS[dt.name]:
        return NARROW_FLOATS[dt.name]
    if dt.kind not in NUMERIC_KINDS:
        raise TypeError(f"{argument}: {dtype!r} ({dt}) is not a numeric or bool dtype; plans "
                        "move bool, integer, floating and complex tensors (and bfloat16, "
                        f"{', '.join(n for n in NARROW_FLOATS if n != 'bfloat16')})")
    if not dt.isnative:
        raise TypeError(f"{argument}: {dtype!r} is {'big' if dt.byteorder == '>' else 'little'}"
                        "-endian, not this machine's byte order; convert the tensor first "
                        f"(x.astype({dt.newbyteorder('=').name!r}))")
    return np.dtype(dt.name)


def is_floating(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a real floating type (numpy's or a narrow one)."""
    return dtype.kind == "f" or dtype.name in NARROW_FLOATS


__all__ = ["NARROW_FLOATS", "NUMERIC_KINDS", "check_dtype", "is_floating"]
