"""`harnessrl gateway`: start the gateway (settings from `--config`, `HRL_GATEWAY_*` and flags)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.gateway.settings import load_gateway_settings
from harnessrl.shared.commands import run_subcommand
from harnessrl.shared.settings import SettingsError


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `gateway` subcommand."""
    parser = subparsers.add_parser("gateway", help="run the LLM gateway (OpenAI/Anthropic endpoint)")
    parser.add_argument("--config", help="TOML file with a [gateway] table")
    parser.add_argument("--host", help="listen address")
    parser.add_argument("--port", type=int, help="listen port")
    parser.add_argument("--nats-url", dest="nats_url", help="NATS server URL")
    parser.add_argument("--upstream", dest="upstreams", action="append", help="vLLM base URL")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load settings and serve until SIGTERM/SIGINT."""
    flags = {name: getattr(args, name) for name in ("host", "port", "nats_url", "upstreams")}
    try:
        settings = load_gateway_settings(args.config, **flags)
    except SettingsError as exc:
        raise SystemExit(f"harnessrl gateway: {exc}") from exc
    from harnessrl.gateway.server import serve

    serve(settings)
    return 0


def main() -> None:
    """`python -m harnessrl.gateway`."""
    run_subcommand(register, "gateway")
