"""dlrover-run: a drop-in for torchrun backed by the job master (being built; see issue 4)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the dlrover-run console script."""
    print("dlrover-run is not available yet in this build", file=sys.stderr)
    return 2
