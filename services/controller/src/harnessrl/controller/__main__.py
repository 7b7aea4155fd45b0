"""`python -m harnessrl.controller [--config FILE]` runs the controller service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harnessrl.controller.app import run


def main() -> int:
    """Parse the few process options; everything else comes from settings."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.controller")
    parser.add_argument("--config", type=Path, default=None, help="TOML file with a [controller] table")
    args = parser.parse_args()
    return run(args.config)


if __name__ == "__main__":
    sys.exit(main())
