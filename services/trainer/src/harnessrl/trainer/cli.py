"""`harnessrl trainer`: start the trainer service (settings from `--config`, env and flags)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.shared.commands import run_subcommand
from harnessrl.shared.settings import SettingsError


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `trainer` subcommand."""
    parser = subparsers.add_parser("trainer", help="run the trainer (verl engine, weight sync)")
    parser.add_argument("--config", help="TOML file with a [trainer] table")
    parser.add_argument("--run", help="run id")
    parser.add_argument("--model-dir", dest="model_dir", help="starting policy (HF directory)")
    parser.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="checkpoint root")
    parser.add_argument("--nats-url", dest="nats_url", help="NATS server URL")
    parser.add_argument("--replica", dest="replicas", action="append", help="vLLM base URL")
    parser.add_argument("--mode", choices=("sync", "async"), help="on-policy or bounded staleness")
    parser.add_argument("--staleness", type=int, help="allowed version lag in async mode")
    parser.add_argument("--batch-groups", dest="batch_groups", type=int, help="groups per step")
    parser.add_argument("--max-steps", dest="max_steps", type=int, help="stop after this step")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load settings and run until interrupted or `max_steps`."""
    # Imported on use: `harnessrl --help` must not pay for importing torch and verl.
    from harnessrl.trainer.app import main
    from harnessrl.trainer.settings import read_settings

    names = ("run", "model_dir", "checkpoint_dir", "nats_url", "replicas", "mode", "staleness")
    overrides = {name: getattr(args, name, None) for name in (*names, "batch_groups", "max_steps")}
    try:
        settings = read_settings(args.config, **overrides)
    except SettingsError as exc:
        raise SystemExit(f"harnessrl trainer: {exc}") from exc
    main(settings)
    return 0


def main() -> None:
    """`python -m harnessrl.trainer`."""
    run_subcommand(register, "trainer")
