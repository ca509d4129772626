"""The concurrency contract (docs/concepts/concurrency.md) states numbers — a row's size, the
graces, the ticks — each with the code name that holds it: every one must be what the code
says, so the page cannot drift from the code unseen."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "concurrency.md"
UNITS = {"bytes": 1, "s": 1.0, "ms": 1e-3, "µs": 1e-6}


def _rows() -> list[tuple[str, str, str]]:
    """(what, value, sources) of each row of the page's "The numbers" table."""
    text = PAGE.read_text()
    table = text[text.index("## The numbers"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


ROWS = _rows()


def _values(value: str) -> list[float]:
    """"0.25 s" -> [0.25]; "50 µs" -> [5e-05]; "544 bytes" -> [544]; "4, 64" -> [4, 64]."""
    number, _, unit = value.rpartition(" ")
    if unit not in UNITS:  # (no unit: plain numbers)
        number, unit = value, ""
    scale = UNITS[unit] if unit else 1
    return [float(v) * scale for v in re.split(r",\s*", number)]


def test_the_page_states_its_numbers():
    assert len(ROWS) >= 8
    assert _values("50 µs") == [pytest.approx(50e-6)] and _values("4, 64") == [4, 64]


@pytest.mark.parametrize("what, value, sources", ROWS, ids=[r[0][:40] for r in ROWS])
def test_each_number_of_the_page_is_the_codes(what, value, sources):
    names = re.findall(r"`([\w.]+):(\w+)`", sources)
    assert names, sources
    got = [getattr(importlib.import_module(module), attr) for module, attr in names]
    assert got == [pytest.approx(v, rel=1e-9) for v in _values(value)], (what, got)
