"""What the multi-process tests read back from a job's processes (``tests/mpi_jobs/job.py``
writes it), whichever launcher started them: mpiexec or torchrun."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


def outputs(out: Path, n: int) -> list[dict[str, np.ndarray]]:
    """Each rank's saved arrays, narrow floats put back to their dtype (``job.savable``)."""
    ranks = []
    for r in range(n):
        saved = dict(np.load(out / f"rank{r}.npz"))
        for key in [k for k in saved if k.endswith(".dtype")]:
            name = str(saved.pop(key))
            base = key[:-len(".dtype")]
            saved[base] = saved[base].view(np.dtype(name))
        ranks.append(saved)
    return ranks


def assert_same_as_single(ranks: list[dict[str, np.ndarray]], single: dict[str, np.ndarray],
                          replicated: tuple[str, ...] = ()) -> None:
    """Every rank's arrays equal the one-process run's, bit for bit; every per-device array
    comes from exactly one rank, and together they cover the one-process run."""
    seen: dict[str, int] = {}
    for r, arrays in enumerate(ranks):
        for key, a in arrays.items():
            assert key in single, f"rank {r} wrote {key}, the one-process run did not"
            b = single[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert a.tobytes() == b.tobytes(), f"rank {r}: {key} differs from one process"
            if not any(s in key for s in replicated):
                assert key not in seen, f"{key} from ranks {seen[key]} and {r}"
                seen[key] = r
    missing = [k for k in single if k not in seen and not any(s in k for s in replicated)]
    assert not missing, f"no rank produced {missing[:5]}"


def links_of(out: Path, n: int) -> list[dict | None]:
    return [json.loads((out / f"links{r}.json").read_text()) for r in range(n)]


def verdicts(text: str) -> str:
    """What each rank said in the end (its log lines, the errors it raised, its abort), for
    assertion messages: the whole output of four tracebacks is too long to show."""
    keep = ("overlap: ", "overlap.errors.", "Abort(", "BAD TERMINATION", "KILLED")
    lines = (re.sub(r"^\[rank\d+\]:", "", line).lstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line.startswith(keep) or "Error: " in line)
