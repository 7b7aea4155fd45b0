"""`harnessrl gateway`: start the gateway (settings from `--config`, `HRL_GATEWAY_*` and flags)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from harnessrl.gateway.settings import ENV_PREFIX, load_gateway_settings
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
    parser.add_argument("--server", choices=("uvicorn", "granian"), help="ASGI server")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load settings and serve until interrupted."""
    # Flags become environment settings: granian's worker rebuilds the app from the environment.
    for name in ("host", "port", "nats_url", "upstreams", "server"):
        value = getattr(args, name, None)
        if value is not None:
            os.environ[f"{ENV_PREFIX}{name.upper()}"] = (
                value if isinstance(value, str) and name != "upstreams" else json.dumps(value)
            )
    if args.config:
        os.environ["HRL_GATEWAY_CONFIG"] = args.config
    try:
        settings = load_gateway_settings(args.config)
    except SettingsError as exc:
        raise SystemExit(f"harnessrl gateway: {exc}") from exc
    from harnessrl.gateway.server import serve

    serve(settings)
    return 0


def main() -> None:
    """`python -m harnessrl.gateway`."""
    run_subcommand(register, "gateway")
