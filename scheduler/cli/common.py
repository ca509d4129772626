"""What both command lines (``overlap plan``, ``overlap simulate``) parse the same way:
sharding specs and meshes, planner options, resharding case files, the machine line the
benchmarks print."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

from ..balance import BALANCES
from ..cluster import Cluster
from ..mesh import DeviceMesh
from ..planner import STRATEGIES, PlanOptions
from ..sharding import Sharding, ShardingSpec


@dataclass(frozen=True)
class Case:
    """A resharding problem: a ``shape``/``dtype`` tensor from ``src`` to ``dst`` on
    ``cluster`` (what a case file holds; the benchmark suites are lists of these)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding
    cluster: Cluster


class OneLineErrors(argparse.ArgumentParser):
    """An argument error is one line, ``error: <argument>: <what is wrong>``, and exit 2 —
    as every other refused input of the CLI (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message.removeprefix('argument ')}\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each option's help — unless the help already says
    its default in words, or there is none to show (None, an empty string)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS) \
                or action.nargs == 0:  # (a switch: off unless given)
            return text
        return super()._get_help_string(action)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose help shows every option's default, once, and whose errors are one
    line."""
    return OneLineErrors(prog=prog, description=description,
                         formatter_class=DefaultsHelpFormatter)


SPEC_FLAGS = ("--src-spec", "--dst-spec")


def joined_specs(argv: Sequence[str]) -> list[str]:
    """``--src-spec -,gpu`` as ``--src-spec=-,gpu``: a spec may start with ``-`` (an unsplit
    dim), which argparse would otherwise take for an option."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] in SPEC_FLAGS and i + 1 < len(args) and args[i + 1].startswith("-") \
                and not args[i + 1].startswith("--"):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


T = TypeVar("T")
MAX_JSON_BYTES = 64 << 20  # a case file is kilobytes; a bigger one is not a case


def read_json_file(path: Path, argument: str) -> object:
    """The JSON in ``path``; ValueError naming ``argument`` if it is missing, not a regular
    file (``/dev/zero``), over :data:`MAX_JSON_BYTES`, or not JSON (nested too deep too)."""
    try:
        if not path.is_file():
            raise ValueError(f"{argument}: no such file: {path}" if not path.exists() else
                             f"{argument}: {path} is not a regular file")
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{argument}: {path} is {size} bytes; a case file is at most "
                             f"{MAX_JSON_BYTES}")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{argument}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{argument}: {path} is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{argument}: {path} nests its JSON too deep") from None


def interpret_case(path: Path, data: object, build: Callable[[dict], T]) -> T:
    """``build(data)`` for the case file ``path``: a field that is missing or of the wrong
    kind becomes a ValueError naming the file and the field (never a traceback)."""
    if not isinstance(data, dict):
        raise ValueError(f"--case: {path} holds no JSON object")
    try:
        return build(data)
    except KeyError as exc:
        raise ValueError(f"--case: {path}: missing field {exc.args[0]!r}") from None
    except (IndexError, AttributeError, TypeError) as exc:
        raise ValueError(f"--case: {path}: a field of the wrong kind or length "
                         f"({type(exc).__name__}: {exc})") from None
    except RecursionError:
        raise ValueError(f"--case: {path}: nested too deep") from None


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a count: steps, microbatches, a width)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (a learning rate, a ratio)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def output_dir(text: str) -> Path:
    """An argparse ``type``: a folder to write into — one that exists, or one that can be
    made (its nearest existing parent is a writable folder). Nothing is made here: a refused
    command leaves no trace."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{path}: no permission to write there")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot make {path}: {parent} is not a writable "
                                         "directory")
    return path


def write_output(path: Path, text: str, argument: str) -> bool:
    """Write the output file the user named (``--json``), or print the one-line error;
    whether it was written."""
    try:
        write_text(path, text, argument)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def write_text(path: Path, text: str, argument: str) -> None:
    """Write an output file the user named; ValueError naming ``argument`` when it cannot
    be (a directory, a missing parent, no permission)."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise ValueError(f"{argument}: cannot write {path}: {exc.strerror or exc}") from None


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The planner's flags: --strategy, --balance, --seed, --budget."""
    defaults = PlanOptions()
    p.add_argument("--strategy", default=defaults.strategy, choices=STRATEGIES,
                   help="how a transfer moves: point-to-point, local all-gather, broadcast")
    p.add_argument("--balance", default=defaults.balance, choices=BALANCES,
                   help="how transfers are spread over senders")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="seed of the randomised balancers")
    p.add_argument("--budget", type=int, default=defaults.budget,
                   help="work units the balancer may spend (never seconds)")


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The :class:`PlanOptions` of parsed :func:`add_plan_options` flags (ValueError naming
    the flag for a bad value)."""
    try:
        return PlanOptions(args.strategy, args.balance, args.seed, args.budget)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--{exc}") from None


def parse_spec(text: str) -> ShardingSpec:
    entries: list[object] = []
    for raw in text.split(","):
        item = raw.strip()
        if item in ("", "-", "None", "none"):
            entries.append(None)
        elif "+" in item:
            entries.append(tuple(part.strip() for part in item.split("+")))
        else:
            entries.append(item)
    return ShardingSpec(*entries)


def parse_mesh(text: str, cluster: Cluster, *, argument: str) -> DeviceMesh:
    try:
        hosts_part, _, gpus_part = text.partition("x")
        first, _, stop = hosts_part.partition(":")
        lo = int(first)
        hi = int(stop) if stop else lo + 1
        gpus = int(gpus_part) if gpus_part else cluster.gpus_per_host
    except ValueError:
        raise ValueError(
            f"{argument}: expected FIRST:STOP[xGPUS] (hosts FIRST..STOP-1), got {text!r}"
        ) from None
    if not 0 <= lo < hi <= cluster.num_hosts:
        raise ValueError(f"{argument}: hosts {lo}:{hi} are not within 0:{cluster.num_hosts}")
    if not 1 <= gpus <= cluster.gpus_per_host:
        raise ValueError(f"{argument}: {gpus} GPUs per host; the cluster has "
                         f"{cluster.gpus_per_host}")
    return cluster.mesh(range(lo, hi), gpus=gpus)


def case_from_json(data: dict) -> Case:
    missing = {"cluster", "shape", "src", "dst"} - set(data)
    if missing:
        raise ValueError(f"case file: missing keys {sorted(missing)}")
    return Case(
        name=str(data.get("name", "case")),
        shape=tuple(data["shape"]),
        dtype=str(data.get("dtype", "float32")),
        src=Sharding.from_json(data["src"]),
        dst=Sharding.from_json(data["dst"]),
        cluster=Cluster.from_dict(data["cluster"]),
    )


def machine_line() -> str:
    return (f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}")


def line_buffered_stdout() -> None:
    """Print each line as it is written, also into a pipe or a file (a benchmark that runs for
    minutes shows its rows as they finish, not all at its end)."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # (a replaced stdout may lack it)
    if reconfigure is not None:
        reconfigure(line_buffering=True)

