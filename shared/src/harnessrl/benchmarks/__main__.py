"""Run one benchmark by name; its last stdout line is one JSON object."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points


def main(argv: list[str]) -> int:
    """Dispatch to the benchmark registered under `argv[0]`."""
    found = {ep.name: ep for ep in entry_points(group="harnessrl.benchmarks")}
    if len(argv) != 1 or argv[0] not in found:
        sys.stderr.write(f"usage: python -m harnessrl.benchmarks {{{','.join(sorted(found))}}}\n")
        return 2
    found[argv[0]].load()()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
