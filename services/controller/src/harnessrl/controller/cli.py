"""`harnessrl controller`, `harnessrl run submit|status` and `harnessrl episode open|close`.

User commands talk to the running controller over the bus (request-reply) and print either a short
human summary or, with `--json`, the reply as JSON. Errors are one sentence on stderr, exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.controller import app
from harnessrl.controller.errors import ControllerError
from harnessrl.controller.task_files import TaskFileError, load_tasks
from harnessrl.shared import control_api, net
from harnessrl.shared.log import configure_logging
from harnessrl.shared.runspec import RunSpecError, load_run_spec


class CommandError(ControllerError):
    """A user command failed; the message is what the user sees."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the controller's commands to the `harnessrl` parser."""
    service = subparsers.add_parser("controller", help="run the controller service")
    app.add_arguments(service)
    service.set_defaults(func=app.run)

    run = subparsers.add_parser("run", help="submit a run or show its progress")
    run_sub = run.add_subparsers(dest="run_command", required=True)
    submit = run_sub.add_parser("submit", help="validate a run spec and start it")
    submit.add_argument("spec", type=Path, help="run spec (.toml or .yaml)")
    status = run_sub.add_parser("status", help="phase counts of one run or all runs")
    status.add_argument("run", nargs="?", default=None)
    for parser, func in ((submit, _cmd_submit), (status, _cmd_status)):
        _bus_options(parser)
        parser.set_defaults(func=func)

    episode = subparsers.add_parser("episode", help="bring-your-own episodes")
    ep_sub = episode.add_subparsers(dest="episode_command", required=True)
    opened = ep_sub.add_parser("open", help="open an episode; prints base URL and key")
    opened.add_argument("--run", required=True)
    opened.add_argument("--task", default=None, help="task id (default: the run's next task)")
    closed = ep_sub.add_parser("close", help="end an episode, optionally with its artifact")
    closed.add_argument("--key", default=os.environ.get("HARNESSRL_EPISODE_KEY"), help="episode key")
    closed.add_argument("--exit-code", type=int, default=0)
    closed.add_argument("--artifact", type=Path, default=None, help="file with the answer or patch")
    closed.add_argument("--kind", choices=("answer", "patch"), default="answer")
    for parser, func in ((opened, _cmd_open), (closed, _cmd_close)):
        _bus_options(parser)
        parser.set_defaults(func=func)


def _bus_options(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    default = env.get("HRL_NATS_URL") or env.get("HRL_CONTROLLER_NATS_URL") or net.DEFAULT_NATS_URL
    parser.add_argument("--nats", default=default, help=f"NATS URL (default {default})")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    parser.add_argument("--timeout", type=float, default=15.0)


async def probe_nats(url: str) -> None:
    """Fail fast with a clear sentence when nothing listens at the NATS URL (the client would retry)."""
    try:
        await net.probe_nats(url, timeout_s=3.0)
    except net.NatsUnreachable as exc:
        raise CommandError(str(exc)) from exc


async def ask(nats: str, verb: str, request: control_api.Request, timeout: float) -> dict[str, Any]:
    """Send one control request to the controller; a refusal raises `CommandError`."""
    # Imported here, after logging is configured: the bus binds its loggers at import time.
    from harnessrl.shared.bus import BusError, NatsBus

    await probe_nats(nats)
    bus = NatsBus(nats, name="harnessrl-cli")
    try:
        await asyncio.wait_for(bus.connect(), timeout)
        raw = await bus.request(control_api.subject(verb), control_api.encode(request), timeout=timeout)
    except TimeoutError as exc:
        raise CommandError(f"cannot connect to NATS at {nats} within {timeout}s") from exc
    except BusError as exc:
        raise CommandError(f"{exc} (is the controller running?)") from exc
    finally:
        if bus.connected:
            await bus.close()
    reply: dict[str, Any] = json.loads(raw)
    if not reply.get("ok"):
        raise CommandError(str(reply.get("error", "refused")))
    return reply


def _answer(
    args: argparse.Namespace, verb: str, request: control_api.Request, human: Callable[[dict[str, Any]], str]
) -> int:
    try:
        reply = asyncio.run(ask(args.nats, verb, request, args.timeout))
    except CommandError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stdout.write(json.dumps(reply, indent=2) + "\n" if args.json else human(reply))
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    try:
        spec = load_run_spec(args.spec)
        tasks = load_tasks(spec.tasks, spec.dataset)
    except (RunSpecError, TaskFileError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return _answer(
        args,
        "submit",
        control_api.SubmitRequest(spec=msgspec.to_builtins(spec)),
        lambda r: (
            f"run {r['run']} submitted: {len(tasks)} tasks, {r['groups']} groups of {r['group_size']}\n"
        ),
    )


def _cmd_status(args: argparse.Namespace) -> int:
    def human(reply: dict[str, Any]) -> str:
        lines = []
        for name, info in reply["runs"].items():
            phases = ", ".join(f"{k}={v}" for k, v in sorted(info.get("phases", {}).items()))
            lines.append(f"{name}: {info['state']} {phases}".rstrip())
            if stopped := info.get("stopped"):
                lines.extend(_stopped_lines(stopped))
        refused = sum(reply.get("refused", {}).values())
        if refused:
            lines.append(f"submissions refused since the controller started: {refused}")
        return "\n".join(lines or ["no runs"]) + "\n"

    return _answer(args, "status", control_api.StatusRequest(run=args.run), human)


def _stopped_lines(stopped: dict[str, Any]) -> list[str]:
    """Why a run stopped: the shared failure, where the logs are, the tail of one stderr."""
    lines = [
        f"  stopped: all {stopped['episodes']} episodes of its first groups failed "
        f"({stopped['cause']}: {stopped['reason']})",
        f"  logs: {stopped['logs'] or '(none)'}",
    ]
    if stopped.get("detail"):
        lines.append("  stderr tail:")
        lines.extend(f"    {line}" for line in str(stopped["detail"]).splitlines()[-10:])
    return lines


def _cmd_open(args: argparse.Namespace) -> int:
    def human(r: dict[str, Any]) -> str:
        return (
            f"# episode {r['episode']} of run {r['run']} (task {r['task']})\n"
            f"export OPENAI_BASE_URL={r['base_url']}\nexport OPENAI_API_KEY={r['key']}\n"
            f"export ANTHROPIC_BASE_URL={r['anthropic_base_url']}\nexport ANTHROPIC_API_KEY={r['key']}\n"
            f"export HARNESSRL_EPISODE_KEY={r['key']}\n"
            f"export HARNESSRL_TASK={shlex.quote(r['prompt'])}\n"
        )

    return _answer(args, "open", control_api.OpenRequest(run=args.run, task=args.task), human)


def _cmd_close(args: argparse.Namespace) -> int:
    if not args.key:
        sys.stderr.write("error: give --key or set HARNESSRL_EPISODE_KEY\n")
        return 1
    artifact_b64 = None
    if args.artifact is not None:
        try:
            artifact_b64 = base64.b64encode(args.artifact.read_bytes()).decode()
        except OSError as exc:
            sys.stderr.write(f"error: cannot read artifact {args.artifact}: {exc.strerror}\n")
            return 1
    request = control_api.CloseRequest(
        key=args.key, exit_code=args.exit_code, artifact_b64=artifact_b64, kind=args.kind
    )
    return _answer(args, "close", request, lambda r: f"episode {r['episode']} closed: {r['phase']}\n")


def main(argv: list[str] | None = None) -> int:
    """The controller commands alone (`python -m harnessrl.controller.cli`), without the rest."""
    configure_logging("console", "WARNING")
    parser = argparse.ArgumentParser(prog="harnessrl")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
