"""`harnessrl gateway`: start the gateway (settings from `--config`, `HRL_GATEWAY_*` and flags)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.gateway import app


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `gateway` subcommand."""
    parser = subparsers.add_parser("gateway", help="run the LLM gateway (OpenAI/Anthropic endpoint)")
    app.add_arguments(parser)
    parser.set_defaults(func=app.run)
