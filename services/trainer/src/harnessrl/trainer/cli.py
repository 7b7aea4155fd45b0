"""`harnessrl trainer`: the trainer service as a subcommand of the `harnessrl` command."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.trainer import app


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `trainer` subcommand (the same options as `python -m harnessrl.trainer`)."""
    parser = subparsers.add_parser("trainer", help="run the trainer (verl engine, weight sync)")
    app.add_arguments(parser)
    parser.set_defaults(func=app.run)
