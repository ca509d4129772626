"""The ``overlap`` command: the same subcommands as ``python -m scheduler`` (plan, simulate,
partition, trace, profile)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from scheduler.cli import main as dispatch

    return dispatch(argv, prog="overlap")


if __name__ == "__main__":
    sys.exit(main())
