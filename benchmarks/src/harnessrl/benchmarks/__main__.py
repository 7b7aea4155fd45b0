"""Run one benchmark by name; its last stdout line is one JSON object."""

from __future__ import annotations

import importlib
import sys

from harnessrl.benchmarks import NAMES


def main(argv: list[str]) -> int:
    """Run the benchmark module `harnessrl.benchmarks.<argv[0]>`."""
    if len(argv) != 1 or argv[0] not in NAMES:
        sys.stderr.write(f"usage: python -m harnessrl.benchmarks {{{','.join(NAMES)}}}\n")
        return 2
    importlib.import_module(f"harnessrl.benchmarks.{argv[0]}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
