"""The `harnessrl` command.

`up` and `status` live here; every service adds its own subcommands through the entry point group
`harnessrl.commands` (a `register(subparsers)` callable), so this module never imports a service.
"""

from __future__ import annotations

import argparse
import importlib.util
import secrets
import sys
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harnessrl.shared.log import configure_logging
from harnessrl.shared.natsserver import NatsServer, NatsServerError, free_port
from harnessrl.shared.supervisor import (
    ProcessSpec,
    Supervisor,
    SupervisorError,
    pid_alive,
    read_state,
)

SERVICES = ("gateway", "reward", "controller", "trainer")
console = Console(stderr=True)


def home_dir(path: str | None) -> Path:
    """The local state folder (`.harnessrl` in the working directory by default)."""
    home = Path(path or ".harnessrl").resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def episode_secret(home: Path) -> str:
    """The episode-key signing secret of this local deployment, created once, readable only by us."""
    path = home / "episode-key.secret"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path.read_text().strip()


def service_env(home: Path, nats_url: str, gateway_port: int) -> dict[str, str]:
    """Environment shared by the local services: where NATS and the gateway are, the key secret."""
    secret = episode_secret(home)
    env = {"HRL_NATS_URL": nats_url, "HRL_HOME": str(home)}
    for svc in SERVICES:
        env[f"HRL_{svc.upper()}_NATS_URL"] = nats_url
    env["HRL_GATEWAY_PORT"] = str(gateway_port)
    env["HRL_GATEWAY_KEY_SECRET"] = secret
    env["HRL_CONTROLLER_KEY_SECRET"] = secret
    env["HRL_CONTROLLER_GATEWAY_URL"] = f"http://127.0.0.1:{gateway_port}"
    return env


def installed_services() -> list[str]:
    """Services whose package is installed and runnable with `python -m`."""
    return [s for s in SERVICES if importlib.util.find_spec(f"harnessrl.{s}.__main__") is not None]


def service_specs(env: dict[str, str], gateway_port: int) -> list[ProcessSpec]:
    """One supervised process per installed service."""
    specs = []
    for svc in installed_services():
        ready = f"http://127.0.0.1:{gateway_port}/healthz" if svc == "gateway" else None
        url = f"http://127.0.0.1:{gateway_port}" if svc == "gateway" else ""
        argv = [sys.executable, "-m", f"harnessrl.{svc}"]
        specs.append(ProcessSpec(name=svc, argv=argv, env=env, ready_url=ready, url=url))
    return specs


def cmd_up(args: argparse.Namespace) -> int:
    """Start nats-server and every installed service; supervise until Ctrl-C."""
    home = home_dir(args.home)
    supervisor = Supervisor(home)
    nats = NatsServer(home / "nats", port=args.nats_port, log_file=home / "logs" / "nats-server.log")
    try:
        nats.start()
        gateway_port = args.gateway_port or free_port()
        env = service_env(home, nats.url, gateway_port)
        for spec in service_specs(env, gateway_port):
            supervisor.start(spec)
        console.print(f"[green]up[/]: nats {nats.url}, services {installed_services()}; Ctrl-C stops")
        while True:
            supervisor.check(on_crash=lambda name, _: console.print(f"[red]{name} crashed; restarting"))
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping")
        return 0
    except (SupervisorError, NatsServerError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        supervisor.stop()
        nats.stop()


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


def build_parser() -> argparse.ArgumentParser:
    """The full parser: built-in commands plus every service's registered ones."""
    parser = argparse.ArgumentParser(prog="harnessrl", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run NATS and every service locally (Ctrl-C stops)")
    up.add_argument("--home", default=None, help="state folder (default .harnessrl)")
    up.add_argument("--nats-port", type=int, default=0)
    up.add_argument("--gateway-port", type=int, default=0)
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="what `harnessrl up` runs where")
    status.add_argument("--home", default=None)
    status.set_defaults(func=cmd_status)
    for ep in sorted(entry_points(group="harnessrl.commands"), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `harnessrl` command."""
    args = build_parser().parse_args(argv)
    configure_logging("console", args.log_level)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
