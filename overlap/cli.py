"""The ``overlap`` command. Subcommands grow with the runtime; today: ``plan``, ``simulate``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = ("plan", "simulate")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: overlap COMMAND [options]\n\ncommands:\n"
              "  plan      plan a cross-mesh resharding (or --suite paper) and cost it\n"
              "  simulate  compare gpipe / 1f1b / eager-1f1b / signal on a pipeline")
        return 0 if argv else 2
    if argv[0] == "plan":
        from scheduler.cli import plan_main

        return plan_main(argv[1:])
    if argv[0] == "simulate":
        from scheduler.sim_cli import simulate_main

        return simulate_main(argv[1:])
    print(f"overlap: unknown command {argv[0]!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
