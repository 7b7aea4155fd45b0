"""The `harnessrl` command.

`up`, `status`, `train` and `demo` live here; every service adds its own subcommands through the
entry point group `harnessrl.commands` (a `register(subparsers)` callable), so this parser needs no
service's code to list them (and `harnessrl --help` loads none of their heavy parts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import textwrap
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harnessrl.shared.bus import BusError
from harnessrl.shared.log import configure_logging
from harnessrl.shared.nats_permissions import redacted
from harnessrl.shared.net import DEFAULT_NATS_URL
from harnessrl.shared.runspec import RunSpecError, load_run_spec
from harnessrl.stack import otlp, replay, tail, tasks_check
from harnessrl.stack.dashboard import command as dashboard
from harnessrl.stack.follow import RunProgress
from harnessrl.stack.local import LocalStack, StackPorts
from harnessrl.stack.natsserver import NatsServerError
from harnessrl.stack.readiness import wait_serving
from harnessrl.stack.supervisor import SupervisorError, pid_alive, read_state
from harnessrl.stack.train import TrainError, TrainSession
from harnessrl.stack.vllm import VllmServerError

console = Console(stderr=True)


def home_dir(path: str | None) -> Path:
    """The local state folder (`.harnessrl` in the working directory by default)."""
    home = Path(path or ".harnessrl").resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def cmd_up(args: argparse.Namespace) -> int:
    """Start nats-server, gateway, reward, controller (vLLM with --model, a run's trainer with --trainer).

    Supervises them until Ctrl-C.
    """
    spec = None
    if args.trainer_ranks > 1 and not args.trainer:
        console.print("[red]error:[/] --trainer-ranks needs --trainer (the run whose trainer it sizes)")
        return 2
    if args.trainer:
        try:
            spec = load_run_spec(args.trainer)
        except RunSpecError as exc:
            console.print(f"[red]bad run spec:[/] {exc}")
            return 2
        if not args.model:
            console.print("[red]error:[/] --trainer needs --model (the policy it trains and vLLM serves)")
            return 2
    ports = StackPorts(nats=args.nats_port, gateway=args.gateway_port)
    stack = LocalStack(home_dir(args.home), ports, nats_nodes=args.nats_cluster, nats_auth=args.nats_auth)
    try:
        stack.start_nats()
        if args.model:
            stack.start_vllm(Path(args.model))
        if spec is not None:
            stack.start_trainer(spec, Path(args.model), ranks=args.trainer_ranks)
        stack.wait_vllm()
        stack.start_gateway()
        stack.start_reward(Path(spec.tasks).parent if spec else None)
        stack.start_controller()
        wait_serving(stack.nats_url, spec.run if spec else None, stack.check)
        trains = f", trainer for run {spec.run}" if spec else ""
        console.print(
            f"[green]up[/]: nats {redacted(stack.nats_url)}, gateway {stack.gateway_url}{trains}; "
            "Ctrl-C stops"
        )
        while True:
            stack.check()
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping")
        return 0
    except (SupervisorError, NatsServerError, VllmServerError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        stack.stop()


def cmd_train(args: argparse.Namespace) -> int:
    """Run (or submit) a training run and follow it to the end."""
    try:
        spec = load_run_spec(args.spec)
    except RunSpecError as exc:
        console.print(f"[red]bad run spec:[/] {exc}")
        return 2
    if args.max_steps is not None:
        spec = msgspec.structs.replace(spec, max_steps=args.max_steps)
    local_only = [flag for flag in ("model", "nats_port", "gateway_port") if getattr(args, flag)]
    if args.nats_url and local_only:
        flags = ", ".join("--" + flag.replace("_", "-") for flag in local_only)
        console.print(
            f"[red]error:[/] {flags} only apply to local runs: with --nats-url the deployment's "
            "trainer and vLLM serve their own model"
        )
        return 2
    ports = StackPorts(nats=args.nats_port, gateway=args.gateway_port)
    model = Path(args.model) if args.model else None
    session = TrainSession(spec, home_dir(args.home), model_dir=model, nats_url=args.nats_url, ports=ports)
    try:
        session.start_stack()
        progress = asyncio.run(session.follow())
        console.print(f"plot: {session.finish()}")
        sys.stdout.write(
            json.dumps({"run": spec.run, "steps": progress.step, "version": progress.version}) + "\n"
        )
        return report(progress, session.run_dir / "summary.json")
    except KeyboardInterrupt:
        console.print("stopped; run the same command again to resume")
        return 130
    except (TrainError, SupervisorError, NatsServerError, VllmServerError, BusError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        session.stop()


def report(progress: RunProgress, summary: Path) -> int:
    """Say what went wrong with a followed run (stop cause, stderr tail, logs); 1 if anything did."""
    problems = progress.problems()
    for problem in problems:
        console.print(f"[red]error:[/] {escape(problem)}")
    stop = progress.stopped
    if stop is not None and stop.detail:
        console.print("the end of one failed episode's stderr:")
        console.print(textwrap.indent(stop.detail.rstrip(), "  "), markup=False, highlight=False)
    if stop is not None and stop.logs:
        console.print(f"its logs: {escape(stop.logs)}")
    if problems:
        console.print(f"summary: {summary}")
    return 1 if problems else 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The built-in demo; exits non-zero when the held-out score does not improve enough."""
    from harnessrl.stack.demo.run import DemoSettings, run_demo

    settings = DemoSettings(steps=args.steps, warm_steps=args.warm_steps)
    try:
        summary = run_demo(home_dir(args.home), settings)
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    except (TrainError, SupervisorError, NatsServerError, VllmServerError, BusError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    ok = summary["improvement"] >= settings.improvement_floor and (
        summary["sampled_after"] - summary["sampled_before"] >= settings.sampled_floor
    )
    if not ok:
        console.print("[red]the held-out score did not improve as expected[/]")
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if ok else 1


def cmd_demo_swe(args: argparse.Namespace) -> int:
    """The coding demo (`make demo-swe`); exits non-zero below the issue's targets."""
    from harnessrl.stack.demo.swe_run import SweDemoSettings, run_swe_demo, targets_met

    given = {"steps": args.steps, "warm_steps": args.warm_steps}
    settings = SweDemoSettings(**{name: value for name, value in given.items() if value is not None})
    try:
        summary = run_swe_demo(home_dir(args.home), settings)
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    except (TrainError, SupervisorError, NatsServerError, VllmServerError, BusError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    ok = targets_met(summary, settings)
    if not ok:
        console.print("[red]the held-out resolve rate did not improve as expected[/]")
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0 if ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Export spans, episode events, rollouts, weights and metrics to Parquet; resumes where it stopped."""
    from harnessrl.stack.export import ExportError, ExportOptions, run_export

    given = {name: value for name, value in vars(args).items() if name in EXPORT_FLAGS}
    started = time.monotonic()
    try:
        options = ExportOptions(out=Path(args.out), **given)
        rows = run_export(options)
    except (ExportError, BusError, OSError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    seconds = round(time.monotonic() - started, 2)
    sys.stdout.write(json.dumps({"out": str(options.out), "rows": rows, "seconds": seconds}) + "\n")
    return 0


# `harnessrl export` flags that override an `ExportOptions` default (the one place that defines them).
EXPORT_FLAGS = ("nats_url", "run", "batch", "flush_s", "until_idle_s")


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`harnessrl export` and its flags; one not given keeps the `ExportOptions` default."""
    export = sub.add_parser(
        "export",
        help="write the event streams to Parquet tables by run and day (resumable, exactly once)",
        argument_default=argparse.SUPPRESS,
    )
    export.add_argument("--out", required=True, metavar="DIR", help="where the tables go")
    export.add_argument("--run", help="export only this run (default: every run)")
    export.add_argument("--nats-url", help=f"NATS URL (default {DEFAULT_NATS_URL})")
    export.add_argument("--batch", type=positive_int, metavar="N", help="messages per commit")
    export.add_argument("--flush-s", type=float, metavar="S", help="commit a partial batch after S seconds")
    export.add_argument(
        "--until-idle",
        dest="until_idle_s",
        type=float,
        metavar="S",
        help="exit once caught up: nothing new for S seconds (default: follow until Ctrl-C)",
    )
    export.set_defaults(func=cmd_export)


def cmd_status(args: argparse.Namespace) -> int:
    """Show what a local `harnessrl up` runs."""
    states = read_state(home_dir(args.home))
    if not states:
        console.print("nothing is running (no .harnessrl/up.json)")
        return 1
    table = Table("service", "pid", "alive", "url", "restarts", "log")
    for s in states:
        table.add_row(s.name, str(s.pid), "yes" if pid_alive(s.pid) else "NO", s.url, str(s.restarts), s.log)
    Console().print(table)
    return 0


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The full parser: built-in commands plus every service's registered ones."""
    parser = argparse.ArgumentParser(prog="harnessrl", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run NATS and every service locally (Ctrl-C stops)")
    up.add_argument("--home", default=None, help="state folder (default .harnessrl)")
    up.add_argument("--nats-port", type=int, default=0)
    up.add_argument(
        "--nats-cluster",
        type=positive_int,
        default=1,
        metavar="N",
        help="run NATS as a JetStream cluster of N servers on loopback (ports from --nats-port on), "
        "streams and buckets replicated on up to 3 of them",
    )
    up.add_argument(
        "--nats-auth",
        action="store_true",
        help="NATS requires a login: each service its own, with only its permissions; the operator's "
        "password is in HOME/nats-admin.secret (user admin). Off by default: the other commands "
        "(`train --nats-url`, `run`, `episode`, `tail`, `export`) connect without one",
    )
    up.add_argument("--gateway-port", type=int, default=0)
    up.add_argument("--model", default=None, help="also serve this model folder with vLLM on the CPU")
    up.add_argument(
        "--trainer",
        default=None,
        metavar="SPEC",
        help="also run the trainer for this run spec's run on --model (then submit it with "
        "`harnessrl train SPEC --nats-url ...`)",
    )
    up.add_argument(
        "--trainer-ranks",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --trainer: train data-parallel on N processes (torchrun; rank 0 runs the service)",
    )
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="what `harnessrl up` runs where")
    status.add_argument("--home", default=None)
    status.set_defaults(func=cmd_status)
    train = sub.add_parser(
        "train", help="run a training job locally (or submit it with --nats-url) and follow it"
    )
    train.add_argument("spec", help="run spec (.toml, .yaml or .json)")
    train.add_argument(
        "--model", default=None, help="policy model folder of a local run (default: the spec's `model`)"
    )
    train.add_argument(
        "--nats-url",
        default=None,
        help="submit to an existing deployment and follow (starts nothing; it trains its own model)",
    )
    train.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="train at most N steps (overrides the spec's max_steps; a shorter try). With --nats-url "
        "it can only lower the count: the deployment's trainer stops at its own max_steps",
    )
    train.add_argument("--home", default=None)
    train.add_argument("--nats-port", type=int, default=0)
    train.add_argument("--gateway-port", type=int, default=0)
    train.set_defaults(func=cmd_train)
    demo = sub.add_parser("demo", help="the built-in run that shows learning on the CPU")
    demo.add_argument("--home", default=None)
    demo.add_argument("--steps", type=int, default=15)
    demo.add_argument("--warm-steps", type=int, default=800)
    demo.set_defaults(func=cmd_demo)
    demos = demo.add_subparsers(dest="demo_kind")
    swe = demos.add_parser("swe", help="the coding demo: mini-swe-agent learning to fix bugs")
    swe.add_argument("--home", default=None)
    swe.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the calibrated recipe's)")
    swe.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default: the recipe's)")
    swe.set_defaults(func=cmd_demo_swe)
    add_export_parser(sub)
    tail.register(sub)
    otlp.register(sub)
    replay.register(sub)
    dashboard.register(sub)
    for ep in sorted(entry_points(group="harnessrl.commands"), key=lambda e: e.name):
        ep.load()(sub)
    tasks_check.register(sub)  # after the services: `tasks check` joins the reward's `tasks` group
    return parser


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both stop a command the orderly way (as KeyboardInterrupt).

    SIGINT is set explicitly: a script's background job (`harnessrl up &`) starts with it ignored,
    and Python then leaves it so. SIGTERM (`kill`, a supervisor, a CI timeout) would otherwise end
    the command at once, leaving its services to die by their parent-death signal in no order.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `harnessrl` command (`argv` None: this process is the command)."""
    args = build_parser().parse_args(argv)
    if argv is None:  # called in-process (tests, embedding), the caller's signal handlers stay
        stop_on_signals()
    configure_logging("console", args.log_level)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
