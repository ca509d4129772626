"""Pipeline schedules: per rank, the order of its compute actions — torch's action lists.

``Schedule.actions[rank]`` is that rank's list of :class:`Action` (``kind``, ``microbatch``,
``stage``), with torch's letters: ``F`` forward, ``B`` full backward, ``I`` input gradient,
``W`` weight gradient (``I`` then ``W`` is a ``B`` split in two, as in Zero Bubble). A rank
holds ``stages_per_rank`` stages — placed ``"loop"`` (stage s on rank s mod ranks, as
Megatron and torch interleave) or ``"v"`` (stage s on rank s for s < ranks, on rank
2·ranks − 1 − s otherwise). With one stage per rank the rank *is* the stage, and an action may
leave its ``stage`` out (``Action("F", 3)``).

One stage per rank, full backward — a warm-up of ``W(s)`` forwards, then one backward and one
forward alternating, then the remaining backwards (``p`` stages, ``m`` microbatches, stage
``s`` 0-based):

- ``gpipe``: ``W = m`` — every forward, then every backward.
- ``1f1b``: ``W = min(m, p − s)`` — the least warm-up that keeps the pipeline full.
- ``eager-1f1b``: ``W = min(m, 2(p − s) − 1)`` — the paper's schedule: about twice the warm-up,
  so every forward output has slack to travel to the next stage while this one keeps
  computing, at up to ~2× the activation memory on early stages.

Their peak number of live activations (F ran, B not yet) of stage ``s`` is exactly ``W(s)``.

More, all lowered to the step graph and run by the runtime like the three above (a rank's
stages share its mesh: the step graph runs the rank's list on its devices' compute streams):

- ``zb-h1`` (Zero Bubble H1, Qi et al. 2024): ``1f1b``'s warm-up, the backward split into
  ``I`` and ``W``, and stage ``s`` holding back its first ``s`` ``W`` so that they fill the
  cool-down bubbles: peak activations ``min(m, p)`` on every stage (1f1b's stage 0, its
  largest), and with F = I = W a bubble a third of 1f1b's when ``m ≥ p``. At that memory
  its steady state hides the boundary transfers (T each way) only while ``T ≤ W / 2``: a
  microbatch holds one of stage 0's ``p`` slots for ``p·F + p·I + W + 2(p − 1)·T`` at least.
- ``interleaved-1f1b`` (Megatron's interleaved 1F1B; ``stages_per_rank`` = v ≥ 2, ``loop``
  placement, ``m`` a multiple of the number of ranks r): each rank runs its stages on groups
  of r microbatches in turn; rank ``k`` warms up with ``min(m·v, 2(r − k − 1) + (v − 1)·r)``
  forwards, then alternates forward and backward. Peak activations of the rank (over its
  stages): that warm-up + 1, at most ``m·v``.
- ``zbv`` (Zero Bubble V, Qi et al.; ``num_stages`` = 2 × ranks, ``v`` placement): the
  backward split, each rank's two stages on the way down and back up the V, listed by
  running the ranks greedily in unit time (see ``_zbv_actions``). Peak activations of a rank:
  ``min(2m, 2·ranks)`` half-size stages — 1f1b's peak for the same model. With F = I = W
  (per half stage, ``m ≥ ranks``, up to 8 ranks checked) its bubble is ``ranks − 1`` to
  ``ranks + 3`` units, against zb-h1's ``2(ranks − 1)`` and 1f1b's ``6(ranks − 1)``;
  torch's ZBVZeroBubble is as short or at most 2 units shorter where compared.

``m < p`` is allowed wherever the schedule allows it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from .errors import check_positive_int, load_json

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")  # one stage per rank, full backward
SPLIT_SCHEDULES = ("zb-h1", "interleaved-1f1b", "zbv")  # schedule values (see module doc)
ALL_SCHEDULES = SCHEDULES + SPLIT_SCHEDULES
PLACEMENTS = ("loop", "v")

Kind = Literal["F", "B", "I", "W"]
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: ``kind`` (F, B, I or W) of ``microbatch`` on ``stage`` (None: the
    rank's only stage)."""

    kind: Kind
    microbatch: int
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("microbatch", "stage"):
            v = getattr(self, name)
            if v is None and name == "stage":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {v!r}")
            if v < 0:
                raise ValueError(f"{name}: must be >= 0, got {v}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def torch_token(self, stage: int) -> str:
        """torch's cell: ``{stage}{kind}{microbatch}`` (``1W3``)."""
        return f"{stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``F3`` (the rank's only stage) or torch's ``1F3`` (stage 1)."""
        text = text.strip()
        k = next((i for i, c in enumerate(text) if not c.isdigit()), len(text))
        head, kind, tail = text[:k], text[k:k + 1], text[k + 1:]
        if kind not in KINDS or not tail.isdigit():
            raise ValueError(f"action: expected F<n>, B<n>, I<n>, W<n> or torch's "
                             f"<stage><kind><n>, got {text!r}")
        return cls(kind, int(tail), int(head) if head else None)  # type: ignore[arg-type]


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


def _zb_h1_actions(p: int, m: int, s: int) -> tuple[Action, ...]:
    """Stage s of zb-h1: 1f1b's warm-up; then I, a held-back W (the first s are held), F;
    then the W still held."""
    w = min(m, p - s)
    out = [Action("F", i) for i in range(w)]
    nxt_f, nxt_w = w, 0
    for k in range(m):
        out.append(Action("I", k))
        if k - s >= nxt_w:
            out.append(Action("W", nxt_w))
            nxt_w += 1
        if nxt_f < m:
            out.append(Action("F", nxt_f))
            nxt_f += 1
    out += [Action("W", i) for i in range(nxt_w, m)]
    return tuple(out)


def interleaved_warmup(ranks: int, per_rank: int, m: int, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward in interleaved-1f1b."""
    return min(m * per_rank, 2 * (ranks - rank - 1) + (per_rank - 1) * ranks)


def _interleaved_actions(ranks: int, v: int, m: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank`` of interleaved-1f1b: its k-th forward is microbatch
    ``(k // (r·v))·r + k % r`` of its stage chunk ``(k // r) % v``; backwards go the same way
    through the chunks in reverse."""

    def nth(k: int, kind: Kind) -> Action:
        chunk = (k // ranks) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, (k // (ranks * v)) * ranks + k % ranks, chunk * ranks + rank)

    total = m * v
    w = interleaved_warmup(ranks, v, m, rank)
    out = [nth(k, "F") for k in range(w)]
    for k in range(total - w):  # steady: a forward, then a backward
        out += [nth(w + k, "F"), nth(k, "B")]
    out += [nth(k, "B") for k in range(total - w, total)]
    return tuple(out)


def _zbv_actions(ranks: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """zbv: two stages per rank in a V (rank k runs stages k and 2·ranks − 1 − k), the
    backward split, listed by running the ranks in unit time steps (F = I = W = 1, free
    communication) and letting each free rank take, in this order: the ready I of its
    oldest microbatch (the gradient's path is the critical one), the ready F of its second
    chunk, the ready F of its first chunk, a held-back W. A rank keeps at most
    ``2·ranks`` microbatches between F and W — 1f1b's peak: as many full-stage activations
    as ranks — and its first chunk stops one short of that, so the second chunk's forward,
    which leads to the loss and so to every backward, always finds room."""
    cap = 2 * ranks
    stages = [(k, 2 * ranks - 1 - k) for k in range(ranks)]  # (chunk 0, chunk 1)
    p = 2 * ranks
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> end time
    nxt = {(s, kind): 0 for s in range(p) for kind in "FI"}  # next microbatch per (stage, kind)
    held: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]  # (stage, mb) awaiting W
    live = [0] * ranks
    out: list[list[Action]] = [[] for _ in range(ranks)]
    t = 0

    def ready(stage: int, kind: str) -> bool:
        i = nxt[(stage, kind)]
        if i >= m:
            return False
        if kind == "F":
            need = (stage - 1, "F", i) if stage > 0 else None
        else:
            need = (stage, "F", i) if stage == p - 1 else (stage + 1, "I", i)
            if (stage, "F", i) not in done or done[(stage, "F", i)] > t:
                return False
        return need is None or done.get(need, t + 1) <= t

    while any(len(acts) < 3 * m * 2 for acts in out):
        for k, (first, second) in enumerate(stages):
            choice: tuple[str, int] | None = None
            for stage in sorted((first, second), key=lambda s: (nxt[(s, "I")], -s)):
                if ready(stage, "I"):
                    choice = ("I", stage)
                    break
            if choice is None and live[k] < cap and ready(second, "F"):
                choice = ("F", second)
            if choice is None and live[k] < cap - 1 and ready(first, "F"):
                choice = ("F", first)
            if choice is None and held[k]:
                stage, i = held[k].pop(0)
                out[k].append(Action("W", i, stage))
                live[k] -= 1
                continue
            if choice is None:
                continue  # idle this step
            kind, stage = choice
            i = nxt[(stage, kind)]
            nxt[(stage, kind)] += 1
            done[(stage, kind, i)] = t + 1
            out[k].append(Action(kind, i, stage))  # type: ignore[arg-type]
            if kind == "F":
                live[k] += 1
            else:
                held[k].append((stage, i))
        t += 1
    return tuple(map(tuple, out))


@dataclass(frozen=True)
class Schedule:
    """Per rank, its actions in execution order (``actions[rank]``); ``num_stages`` stages,
    ``stages_per_rank`` of them on each rank, placed ``placement`` (see module doc)."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    stages_per_rank: int = 1
    placement: str = "loop"
    forward_only: bool = False  # an evaluation step: F alone (see forward_order)

    def __post_init__(self) -> None:
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("num_microbatches", self.num_microbatches)
        check_size(self.num_stages, self.num_microbatches)
        v = check_positive_int("stages_per_rank", self.stages_per_rank)
        if self.num_stages % v:
            raise ValueError(f"stages_per_rank: {self.num_stages} stages do not split into "
                             f"ranks of {v}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {PLACEMENTS}, got "
                             f"{self.placement!r}")
        if not isinstance(self.forward_only, bool):
            raise TypeError(f"forward_only: expected a bool, got {self.forward_only!r}")
        if self.placement == "v" and v != 2:
            raise ValueError(f"placement: 'v' places two stages per rank, not {v}")
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"actions: {len(self.actions)} rank lists for {self.num_ranks} "
                             f"ranks ({self.num_stages} stages, {v} per rank)")
        for r, acts in enumerate(self.actions):
            self._check_rank(r, acts)

    def __hash__(self) -> int:  # (kept by dataclass: an explicit __hash__ wins)
        return self._hash

    @cached_property
    def _hash(self) -> int:
        # Hashed once: a runtime's cache keys on the schedule every step, and hashing every
        # action of 64 stages × 256 microbatches took 3 ms.
        return hash((self.name, self.num_stages, self.num_microbatches, self.actions,
                     self.stages_per_rank, self.placement, self.forward_only))

    @property
    def num_ranks(self) -> int:
        """The ranks the schedule runs on: stages / stages per rank."""
        return self.num_stages // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        r = self.num_ranks
        if self.placement == "v" and stage >= r:
            return 2 * r - 1 - stage
        return stage % r

    @cached_property
    def _rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, its stages: derived once (checking and ordering ask per action)."""
        mine: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s in range(self.num_stages):
            mine[self.rank_of(s)].append(s)
        return tuple(map(tuple, mine))

    @cached_property
    def kinds(self) -> frozenset[str]:
        """The action kinds the schedule uses (``I``/``W``: a split backward)."""
        return frozenset(a.kind for acts in self.actions for a in acts)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in order."""
        return self._rank_stages[rank]

    def stage_of(self, rank: int, action: Action) -> int:
        """The stage ``action`` of rank ``rank``'s list runs."""
        if action.stage is not None:
            return action.stage
        return self._rank_stages[rank][0]  # (one stage per rank: checked)

    def _check_rank(self, r: int, acts: tuple[Action, ...]) -> None:
        mine = self.stages_of(r)
        state: dict[tuple[int, int], str] = {}  # (stage, mb) -> kinds so far
        for a in acts:
            if not isinstance(a, Action):
                raise TypeError(f"actions[{r}]: expected Actions, got {a!r}")
            if a.stage is None and len(mine) > 1:
                raise ValueError(f"actions[{r}]: {a} names no stage, and rank {r} runs "
                                 f"stages {list(mine)}")
            st = self.stage_of(r, a)
            if st not in mine:
                raise ValueError(f"actions[{r}]: {a.torch_token(st)} is on stage {st}, which "
                                 f"runs on rank {self.rank_of(st) if st < self.num_stages else '-'}"
                                 f" (rank {r} runs {list(mine)})")
            if a.microbatch >= self.num_microbatches:
                raise ValueError(f"actions[{r}]: {a.torch_token(st)}: microbatch beyond "
                                 f"0..{self.num_microbatches - 1}")
            done = state.get((st, a.microbatch), "")
            if self.forward_only and a.kind != "F":
                raise ValueError(f"actions[{r}]: {a.torch_token(st)} in a forward-only "
                                 "schedule (F actions alone)")
            need = {"F": "", "B": "F", "I": "F", "W": "FI"}[a.kind]
            if done != need:
                problem = (f"comes before {need[len(done)]}{a.microbatch} of stage {st}"
                           if len(done) < len(need) and need.startswith(done) else
                           f"is one too many (that microbatch ran {done} there already)")
                raise ValueError(f"actions[{r}]: {a.torch_token(st)} {problem}")
            state[(st, a.microbatch)] = done + a.kind
        whole = ("F",) if self.forward_only else ("FB", "FIW")
        for st in mine:
            for i in range(self.num_microbatches):
                if self.forward_only and state.get((st, i)) != "F":
                    raise ValueError(f"actions[{r}]: microbatch {i} of stage {st} needs one F "
                                     f"in a forward-only schedule; got "
                                     f"{state.get((st, i), 'nothing')!r}")
                if state.get((st, i)) not in whole:
                    raise ValueError(f"actions[{r}]: microbatch {i} of stage {st} needs an F "
                                     f"and a B (or an I and a W); got "
                                     f"{state.get((st, i), 'nothing')!r}")

    def forward_order(self) -> Schedule:
        """This schedule's forwards alone, in its order on every rank: an evaluation step
        (nothing waits for a backward, no activation is kept for one)."""
        if self.forward_only:
            return self
        return dataclasses.replace(
            self, name=f"{self.name}/forward", forward_only=True,
            actions=tuple(tuple(a for a in acts if a.kind == "F") for acts in self.actions))

    def peak_activations(self, stage: int) -> int:
        """Most microbatches whose F has run on ``stage`` and whose B (or W) has not."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage: {stage} is not in 0..{self.num_stages - 1}")
        r = self.rank_of(stage)
        return peak_live(a for a in self.actions[r] if self.stage_of(r, a) == stage)

    def peak_rank_activations(self, rank: int) -> int:
        """The same, over every stage of ``rank`` together."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank: {rank} is not in 0..{self.num_ranks - 1}")
        return peak_live(self.actions[rank])

    def to_text(self) -> str:
        """One line per rank: ``s0: F0 F1 B0 …`` (one stage per rank), else torch's cells
        ``r0: 0F0 4F0 …``."""
        if self.stages_per_rank == 1:
            return "\n".join(f"s{s}: " + " ".join(map(str, acts))
                             for s, acts in enumerate(self.actions))
        return "\n".join(f"r{r}: " + " ".join(a.torch_token(self.stage_of(r, a)) for a in acts)
                         for r, acts in enumerate(self.actions))

    @classmethod
    def from_text(cls, text: str, name: str = "custom", *, stages_per_rank: int = 1,
                  placement: str = "loop") -> Schedule:
        """A schedule from :meth:`to_text`'s lines (one per rank: ``F0 F1 B0 ...``)."""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        actions = []
        for r, line in enumerate(lines):
            head, _, body = line.partition(":")
            if head.strip() not in (f"s{r}", f"r{r}"):
                raise ValueError(f"text: line {r + 1} should start with 's{r}:' or 'r{r}:', "
                                 f"got {line!r}")
            actions.append(tuple(Action.parse(tok) for tok in body.split()))
        if not actions:
            raise ValueError("text: no stages")
        return cls._inferred(name, actions, stages_per_rank, placement)

    @classmethod
    def _inferred(cls, name: str, actions: list[tuple[Action, ...]], stages_per_rank: int,
                  placement: str) -> Schedule:
        """A schedule from rank lists alone: microbatches counted on the stage of rank 0's
        first action (the constructor checks every other stage has as many)."""
        first = actions[0][0].stage if actions[0] else None
        m = sum(a.kind == "F" and a.stage == first for a in actions[0])
        return cls(name, len(actions) * stages_per_rank, m, tuple(actions), stages_per_rank,
                   placement)

    def to_json(self) -> str:
        """The schedule as JSON text (:meth:`from_json` reads it back)."""
        return json.dumps({
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stages_per_rank": self.stages_per_rank,
            "placement": self.placement,
            "actions": [[str(a) if a.stage is None else a.torch_token(a.stage) for a in acts]
                        for acts in self.actions],
            **({"forward_only": True} if self.forward_only else {}),
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Schedule:
        """A schedule from :meth:`to_json`'s text; ValueError naming what is wrong."""
        return load_json(text, "schedule JSON", cls._from_data)

    @classmethod
    def _from_data(cls, data: dict) -> Schedule:
        return cls(
            name=str(data["name"]),
            num_stages=data["num_stages"],
            num_microbatches=data["num_microbatches"],
            actions=tuple(tuple(Action.parse(a) for a in acts) for acts in data["actions"]),
            stages_per_rank=data.get("stages_per_rank", 1),
            placement=data.get("placement", "loop"),
            forward_only=data.get("forward_only", False),
        )

    # ---- torch.distributed.pipelining's compute-only CSV -------------------------------

    def to_torch_csv(self) -> str:
        """torch's compute-only CSV: one row per rank, a cell per action (``0F0``, ``1I3``)."""
        return "".join(",".join(a.torch_token(self.stage_of(r, a)) for a in acts) + "\r\n"
                       for r, acts in enumerate(self.actions))

    @classmethod
    def from_torch_csv(cls, text: str, name: str = "torch", *,
                       placement: str | None = None) -> Schedule:
        """Read torch's compute-only CSV (rows = ranks; empty cells — idle steps — skipped).
        Stages per rank and placement are inferred from which rank runs which stage."""
        import csv
        import io

        rows = [row for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)]
        if not rows:
            raise ValueError("text: no ranks in the CSV")
        actions = []
        for r, row in enumerate(rows):
            acts = []
            for c, cell in enumerate(row):
                if not cell.strip():
                    continue
                try:
                    a = Action.parse(cell)
                except ValueError:
                    raise ValueError(f"text: rank {r}, cell {c}: {cell.strip()!r} is not a "
                                     "compute action (F, B, I or W with its stage: torch's "
                                     "compute-only format)") from None
                if a.stage is None:
                    raise ValueError(f"text: rank {r}, cell {c}: {cell.strip()!r} names no "
                                     "stage")
                acts.append(a)
            actions.append(tuple(acts))
        first = sorted({a.stage for a in actions[0]})  # rank 0's stages
        if placement is None:
            n = len(rows) * len(first)
            placement = "v" if first == [0, n - 1] else "loop"
        return cls._inferred(name, actions, len(first), placement)

    def __str__(self) -> str:
        return f"{self.name} (p={self.num_stages}, m={self.num_microbatches})\n{self.to_text()}"


def peak_live(actions: object) -> int:
    """Most microbatches alive at once along ``actions`` (anything with a ``kind``, in
    order): an F adds one, a B or W frees one, an I frees nothing."""
    live = peak = 0
    for a in actions:  # type: ignore[attr-defined]
        live += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
        peak = max(peak, live)
    return peak


MAX_STAGE_MICROBATCHES = 1 << 16  # stages × microbatches (64 × 256 is 16384; 65536
# pairs lower and simulate in about a minute here)


def check_size(num_stages: int, num_microbatches: int) -> None:
    """Refuse, before any work, a schedule too big to list (each stage × microbatch is an
    action of every kind, then ops on every device of its stage)."""
    if num_stages * num_microbatches > MAX_STAGE_MICROBATCHES:
        raise ValueError(f"num_microbatches: {num_stages} stages × {num_microbatches} "
                         f"microbatches is more than {MAX_STAGE_MICROBATCHES} "
                         "(stage, microbatch) pairs; a step of that size is not one schedule")


def make_schedule(name: str, num_stages: int, num_microbatches: int, *,
                  stages_per_rank: int | None = None) -> Schedule:
    """The named schedule (see module doc) for ``num_stages`` × ``num_microbatches``;
    ``stages_per_rank``: 1 by default, 2 for interleaved-1f1b (2 or more) and zbv (2)."""
    if name not in ALL_SCHEDULES:
        raise ValueError(f"name: unknown schedule {name!r}; choose one of {ALL_SCHEDULES}")
    p = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_microbatches", num_microbatches)
    check_size(p, m)
    if name == "interleaved-1f1b":
        v = check_positive_int("stages_per_rank", 2 if stages_per_rank is None
                               else stages_per_rank)
        if v < 2:
            raise ValueError("stages_per_rank: interleaved-1f1b needs at least 2 stages per "
                             "rank (with 1 it is 1f1b)")
        if p % v:
            raise ValueError(f"num_stages: {p} stages do not split into ranks of {v}")
        ranks = p // v
        if m % ranks:
            raise ValueError(f"num_microbatches: interleaved-1f1b runs microbatches in groups "
                             f"of the number of ranks ({ranks}); {m} is not a multiple")
        return Schedule(name, p, m, tuple(_interleaved_actions(ranks, v, m, r)
                                          for r in range(ranks)), v, "loop")
    if name == "zbv":
        if stages_per_rank not in (None, 2):
            raise ValueError(f"stages_per_rank: zbv runs two stages per rank (a V), got "
                             f"{stages_per_rank}")
        if p % 2:
            raise ValueError(f"num_stages: zbv places two stages per rank in a V; {p} is odd")
        return Schedule(name, p, m, _zbv_actions(p // 2, m), 2, "v")
    if stages_per_rank not in (None, 1):
        raise ValueError(f"stages_per_rank: {name} runs one stage per rank, got "
                         f"{stages_per_rank} (interleaved-1f1b and zbv run several)")
    if name == "zb-h1":
        return Schedule(name, p, m, tuple(_zb_h1_actions(p, m, s) for s in range(p)))
    actions = tuple(_stage_actions(warmup(name, p, m, s), m) for s in range(p))
    return Schedule(name, p, m, actions)


def dependency_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A global order of all (stage, action) consistent with every dependency.

    F(s, i) needs F(s−1, i); B or I (s, i) needs the B or I of (s+1, i) — the gradient — and
    on the last stage its own F; W(s, i) needs I(s, i) (and every action what comes before it
    on its rank). Ranks advance in rounds, each running its next action if its dependency is
    done; a round where none can advance means the schedule deadlocks, reported with each
    rank's blocker.
    """
    ranks = schedule.num_ranks
    pos = [0] * ranks
    done: set[tuple[int, str, int]] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(a) for a in schedule.actions)

    def head(r: int) -> tuple[int, Action]:
        a = schedule.actions[r][pos[r]]
        return schedule.stage_of(r, a), a

    while len(order) < total:
        ready = []
        for r in range(ranks):
            if pos[r] == len(schedule.actions[r]):
                continue
            s, a = head(r)
            if all(dep in done for dep in _needs(s, a, schedule.num_stages, done)):
                ready.append((r, s, a))
        if not ready:
            blocked = [f"rank {r} at {head(r)[1].torch_token(head(r)[0])} waits for "
                       + _fmt_needs(_needs(head(r)[0], head(r)[1], schedule.num_stages, done))
                       for r in range(ranks) if pos[r] < len(schedule.actions[r])]
            raise ValueError("schedule deadlocks: " + "; ".join(blocked))
        for r, s, a in ready:
            pos[r] += 1
            done.add((s, a.kind, a.microbatch))
            order.append((s, a))
    return order


def _needs(stage: int, action: Action, p: int, done: set[tuple[int, str, int]]
           ) -> list[tuple[int, str, int]]:
    """What ``action`` of ``stage`` waits for (a gradient from B or I: whichever ran)."""
    i = action.microbatch
    if action.kind == "F":
        return [(stage - 1, "F", i)] if stage > 0 else []
    if action.kind == "W":
        return [(stage, "I", i)]
    if stage == p - 1:
        return [(stage, "F", i)]
    return [(stage + 1, "I" if (stage + 1, "I", i) in done else "B", i)]


def _fmt_needs(needs: list[tuple[int, str, int]]) -> str:
    return " and ".join(f"{k}{i} of stage {s}" for s, k, i in needs) or "nothing"


def compute_only_time(schedule: Schedule, durations: Mapping[str, float]) -> tuple[float, float]:
    """(makespan, bubble): the schedule run with free communication, each action taking
    ``durations[kind]`` (B defaults to I + W); bubble is the mean over ranks of the share of
    the makespan they sat idle."""
    d = {"B": durations.get("I", 0.0) + durations.get("W", 0.0), **durations}
    free = [0.0] * schedule.num_ranks
    end: dict[tuple[int, str, int], float] = {}
    busy = [0.0] * schedule.num_ranks
    for s, a in dependency_order(schedule):
        r = schedule.rank_of(s)
        start = max([free[r], *(end[n] for n in _needs(s, a, schedule.num_stages, end))])
        free[r] = end[(s, a.kind, a.microbatch)] = start + d[a.kind]
        busy[r] += d[a.kind]
    makespan = max(free)
    bubble = sum(1 - b / makespan for b in busy) / len(busy) if makespan else 0.0
    return makespan, bubble
