"""Pipeline schedules: per stage, the order of forward (F) and backward (B) microbatch steps.

Every schedule here has the same shape — a warm-up of ``W(s)`` forwards, then one backward and
one forward alternating, then the remaining backwards — and differs only in ``W(s)`` for stage
``s`` (0-based) of ``p`` stages with ``m`` microbatches:

- ``gpipe``: ``W = m`` — every forward, then every backward.
- ``1f1b``: ``W = min(m, p − s)`` — the least warm-up that keeps the pipeline full.
- ``eager-1f1b``: ``W = min(m, 2(p − s) − 1)`` — the paper's schedule: about twice the warm-up,
  so every forward output has slack to travel to the next stage while this one keeps
  computing, at up to ~2× the activation memory on early stages.

The peak number of live activations (F ran, B not yet) of stage ``s`` is exactly ``W(s)``.
``m < p`` is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from .errors import check_positive_int, load_json

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Action:
    """One compute step of a stage: ``kind`` "F" or "B" of ``microbatch``."""

    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"kind: expected 'F' or 'B', got {self.kind!r}")
        if isinstance(self.microbatch, bool) or not isinstance(self.microbatch, int):
            raise TypeError(f"microbatch: expected an int, got {self.microbatch!r}")
        if self.microbatch < 0:
            raise ValueError(f"microbatch: must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        text = text.strip()
        if len(text) < 2 or text[0] not in "FB" or not text[1:].isdigit():
            raise ValueError(f"action: expected F<n> or B<n>, got {text!r}")
        return cls(text[0], int(text[1:]))  # type: ignore[arg-type]


def warmup(name: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Forwards a stage runs before its first backward."""
    p, m, s = num_stages, num_microbatches, stage
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - s)
    if name == "eager-1f1b":
        return min(m, 2 * (p - s) - 1)
    raise ValueError(f"name: unknown schedule {name!r}; choose one of {SCHEDULES}")


def _stage_actions(w: int, m: int) -> tuple[Action, ...]:
    out = [Action("F", i) for i in range(w)]
    nxt_f, nxt_b = w, 0
    while nxt_b < m:
        out.append(Action("B", nxt_b))
        nxt_b += 1
        if nxt_f < m:
            out.append(Action("F", nxt_f))
            nxt_f += 1
    return tuple(out)


@dataclass(frozen=True)
class Schedule:
    """Per stage, its actions in execution order (``actions[stage]``)."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("num_microbatches", self.num_microbatches)
        if len(self.actions) != self.num_stages:
            raise ValueError(
                f"actions: {len(self.actions)} stage lists for {self.num_stages} stages"
            )
        want = sorted(Action(k, i) for k in ("F", "B") for i in range(self.num_microbatches))
        for s, acts in enumerate(self.actions):
            if sorted(acts) != want:
                raise ValueError(
                    f"actions[{s}]: each microbatch needs exactly one F and one B "
                    f"(0..{self.num_microbatches - 1}); got {' '.join(map(str, acts))}"
                )
            seen_f: set[int] = set()
            for a in acts:
                if a.kind == "F":
                    seen_f.add(a.microbatch)
                elif a.microbatch not in seen_f:
                    raise ValueError(f"actions[{s}]: {a} comes before F{a.microbatch}")

    def peak_activations(self, stage: int) -> int:
        """Most microbatches whose F has run on ``stage`` and whose B has not."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage: {stage} is not in 0..{self.num_stages - 1}")
        live = peak = 0
        for a in self.actions[stage]:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        return peak

    def to_text(self) -> str:
        """One line per stage: ``s0: F0 F1 B0 …``."""
        return "\n".join(
            f"s{s}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.actions)
        )

    @classmethod
    def from_text(cls, text: str, name: str = "custom") -> Schedule:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        actions = []
        for s, line in enumerate(lines):
            head, _, body = line.partition(":")
            if head.strip() != f"s{s}":
                raise ValueError(f"text: line {s + 1} should start with 's{s}:', got {line!r}")
            actions.append(tuple(Action.parse(tok) for tok in body.split()))
        if not actions:
            raise ValueError("text: no stages")
        m = sum(a.kind == "F" for a in actions[0])
        return cls(name, len(actions), m, tuple(actions))

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "actions": [[str(a) for a in acts] for acts in self.actions],
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Schedule:
        return load_json(text, "schedule JSON", cls._from_data)

    @classmethod
    def _from_data(cls, data: dict) -> Schedule:
        return cls(
            name=str(data["name"]),
            num_stages=data["num_stages"],
            num_microbatches=data["num_microbatches"],
            actions=tuple(tuple(Action.parse(a) for a in acts) for acts in data["actions"]),
        )

    def __str__(self) -> str:
        return f"{self.name} (p={self.num_stages}, m={self.num_microbatches})\n{self.to_text()}"


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The named schedule (see module doc) for ``num_stages`` × ``num_microbatches``."""
    if name not in SCHEDULES:
        raise ValueError(f"name: unknown schedule {name!r}; choose one of {SCHEDULES}")
    p = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_microbatches", num_microbatches)
    actions = tuple(_stage_actions(warmup(name, p, m, s), m) for s in range(p))
    return Schedule(name, p, m, actions)


def dependency_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A global order of all (stage, action) consistent with every dependency.

    F(s, i) needs F(s−1, i); B(s, i) needs B(s+1, i) (and F(s, i), earlier on its stage).
    Stages advance in rounds, each running its next action if its dependency is done; a round
    where none can advance means the schedule deadlocks, reported with each stage's blocker.
    """
    p = schedule.num_stages
    pos = [0] * p
    done: set[tuple[int, Action]] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(a) for a in schedule.actions)
    while len(order) < total:
        ready = []
        for s in range(p):
            if pos[s] == len(schedule.actions[s]):
                continue
            a = schedule.actions[s][pos[s]]
            dep = _dependency(s, a, p)
            if dep is None or dep in done:
                ready.append((s, a))
        if not ready:
            blocked = [
                f"stage {s} at {schedule.actions[s][pos[s]]} waits for "
                f"{_fmt_dep(_dependency(s, schedule.actions[s][pos[s]], p))}"
                for s in range(p) if pos[s] < len(schedule.actions[s])
            ]
            raise ValueError("schedule deadlocks: " + "; ".join(blocked))
        for s, a in ready:
            pos[s] += 1
            done.add((s, a))
            order.append((s, a))
    return order


def _dependency(stage: int, action: Action, p: int) -> tuple[int, Action] | None:
    if action.kind == "F":
        return (stage - 1, action) if stage > 0 else None
    return (stage + 1, action) if stage < p - 1 else None


def _fmt_dep(dep: tuple[int, Action] | None) -> str:
    return "nothing" if dep is None else f"{dep[1]} of stage {dep[0]}"
