"""Running one service's `harnessrl` subcommand on its own (`python -m harnessrl.<service>`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

Register = Callable[["argparse._SubParsersAction[Any]"], None]


def run_subcommand(register: Register, command: str) -> NoReturn:
    """Parse `sys.argv` as `harnessrl <command> ...` with only this service's commands; exit."""
    parser = argparse.ArgumentParser(prog="harnessrl")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *sys.argv[1:]])
    raise SystemExit(args.func(args))
