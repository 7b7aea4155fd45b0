"""The `harnessrl otlp` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import msgspec

from harnessrl.shared.bus import BusError
from harnessrl.shared.net import NatsUnreachable
from harnessrl.stack.otlp.consumer import run_export
from harnessrl.stack.otlp.options import OtlpError, OtlpOptions
from harnessrl.stack.tail import at_least_one, nats_url_option, subject_token


def header(text: str) -> tuple[str, str]:
    """An argparse type: `name=value`."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not name=value")
    return name.strip(), value.strip()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `harnessrl otlp` to the `harnessrl` parser."""
    otlp = subparsers.add_parser(
        "otlp",
        help="send every LLM-call span to an OpenTelemetry backend over OTLP/HTTP (resumable, each once)",
    )
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    otlp.add_argument(
        "--endpoint", default=endpoint, required=endpoint is None, metavar="URL",
        help="OTLP/HTTP base URL, e.g. http://localhost:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )  # fmt: skip
    otlp.add_argument("--run", type=subject_token, default=None, help="only this run's spans (default: all)")
    otlp.add_argument(
        "--consumer", type=subject_token, default=None, metavar="NAME",
        help="the durable consumer keeping the position (default otlp-<run> or otlp-all)",
    )  # fmt: skip
    otlp.add_argument("--service-name", default="harnessrl", help="the resource's service.name")
    otlp.add_argument(
        "--include-content", action="store_true",
        help="also send what was said: completions' text (gen_ai.output.messages) and token ids",
    )  # fmt: skip
    otlp.add_argument(
        "--tokenizer", type=Path, default=None, metavar="MODEL_DIR",
        help="with --include-content: the policy's tokenizer, to send each prompt as text too",
    )  # fmt: skip
    otlp.add_argument(
        "--header", type=header, action="append", default=[], metavar="NAME=VALUE",
        help="an extra request header (repeatable), e.g. an API key",
    )  # fmt: skip
    otlp.add_argument("--timeout-s", type=float, default=10.0, metavar="S", help="per request")
    otlp.add_argument("--max-backoff-s", type=float, default=30.0, metavar="S", help="longest retry wait")
    otlp.add_argument(
        "--until-idle", dest="until_idle_s", type=float, default=None, metavar="S",
        help="exit once every span is exported and nothing new came for S seconds (default: follow)",
    )  # fmt: skip
    otlp.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve Prometheus /metrics here"
    )
    otlp.add_argument(
        "--metrics-interval", type=at_least_one, default=None, metavar="S",
        help="publish a metrics summary on the METRICS stream every S seconds",
    )  # fmt: skip
    nats_url_option(otlp)
    otlp.set_defaults(func=cmd_otlp)


def cmd_otlp(args: argparse.Namespace) -> int:
    """Export until Ctrl-C or `--until-idle`; the last line says what was done, as JSON."""
    started = time.monotonic()
    try:
        options = OtlpOptions(
            endpoint=args.endpoint, nats_url=args.nats_url, run=args.run, consumer=args.consumer,
            service_name=args.service_name, include_content=args.include_content, tokenizer=args.tokenizer,
            headers=dict(args.header), timeout_s=args.timeout_s, max_backoff_s=args.max_backoff_s,
            until_idle_s=args.until_idle_s, metrics_port=args.metrics_port,
            metrics_interval_s=float(args.metrics_interval or 0),
        )  # fmt: skip
        done = run_export(options)
    except (OtlpError, BusError, NatsUnreachable, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    record = {**msgspec.to_builtins(done), "seconds": round(time.monotonic() - started, 2)}
    sys.stdout.write(json.dumps(record) + "\n")
    return 0
