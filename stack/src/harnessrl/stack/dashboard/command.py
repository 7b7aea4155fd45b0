"""`harnessrl dashboard` on the command line; the app (Litestar, the sample builder) loads when it runs."""

from __future__ import annotations

import argparse
import asyncio
import sys

from harnessrl.shared.bus import BusError
from harnessrl.shared.net import NatsUnreachable
from harnessrl.stack.tail import TailError, nats_url_option, subject_token


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `harnessrl dashboard` to the `harnessrl` parser."""
    dashboard = subparsers.add_parser(
        "dashboard", help="a live web page of a run, read from the bus (Ctrl-C stops)"
    )
    dashboard.add_argument(
        "--run", type=subject_token, default=None, help="the run the page opens (default: the newest)"
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="address to serve on (default %(default)s)")
    dashboard.add_argument(
        "--port", type=int, default=8765, help="port to serve on, 0 for any free one (default %(default)s)"
    )
    dashboard.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="the policy's tokenizer.json (or model folder) to show token text (default: token ids)",
    )  # fmt: skip
    nats_url_option(dashboard)
    dashboard.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve the dashboard until Ctrl-C."""
    from harnessrl.stack.dashboard.app import Dashboard, DashboardError, serve

    dashboard = Dashboard(nats_url=args.nats_url, run=args.run, tokenizer=args.tokenizer)
    try:
        asyncio.run(serve(dashboard, args.host, args.port))
    except KeyboardInterrupt:
        return 0
    except (DashboardError, TailError, BusError, NatsUnreachable, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0
