"""The embedded local deployment: nats-server, vLLM on the CPU and every service as processes.

`LocalStack` is what `harnessrl up`, `harnessrl train` and `harnessrl demo` run, and what the
end-to-end tests use. NATS is one server, or (`nats_nodes` > 1) a JetStream cluster on loopback whose
URL list every service gets, with its streams and buckets replicated (`HRL_NATS_REPLICAS`).
Every service gets its own typed settings object, handed over as its
`HRL_<SERVICE>_*` variables; the episode-key secret is generated once per state folder and never
leaves this machine.

The embedded NATS requires a login (`nats_auth`, on by default): each service connects as its own
user with the permissions of `harnessrl.shared.nats_permissions` (its password generated once per
state folder, like the key secret) and `nats_url` is the operator's (`admin`) login, for the CLI.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import sys
from pathlib import Path

import msgspec

from harnessrl.controller.launchers.local import end_harnesses
from harnessrl.controller.settings import ControllerSettings
from harnessrl.gateway.settings import GatewaySettings
from harnessrl.reward.grading import local_sandbox
from harnessrl.reward.settings import RewardSettings
from harnessrl.shared.bus import BusError, NatsBus
from harnessrl.shared.bus.nats.streams import REPLICAS_ENV
from harnessrl.shared.contracts import RunSpec
from harnessrl.shared.log import get_logger
from harnessrl.shared.nats_permissions import (
    ADMIN,
    CONTROLLER,
    GATEWAY,
    REWARD,
    TRAINER,
    USERS,
    Credentials,
    with_credentials,
)
from harnessrl.shared.net import free_port
from harnessrl.stack.natsserver import NatsCluster, NatsServer, NatsServerError
from harnessrl.stack.supervisor import ProcessSpec, Supervisor
from harnessrl.stack.vllm import VllmServer
from harnessrl.trainer.settings import EngineSettings, TrainerSettings

log = get_logger(__name__)
SERVED_MODEL = "policy"


class StackPorts(msgspec.Struct, kw_only=True):
    """Ports of the local deployment; 0 picks a free one."""

    nats: int = 0
    gateway: int = 0
    vllm: int = 0


def secret_file(home: Path, name: str) -> str:
    """A random secret stored in the state folder (mode 0600), created on first use."""
    path = home / f"{name}.secret"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path.read_text().strip()


def service_argv(service: str, ranks: int = 1) -> list[str]:
    """The command of a service process: `python -m harnessrl.<service>`, under torchrun for `ranks` > 1."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [sys.executable, *(launcher if ranks > 1 else []), "-m", f"harnessrl.{service}"]


def settings_env(prefix: str, settings: msgspec.Struct) -> dict[str, str]:
    """A service's settings as its `<prefix><FIELD>` environment (fields left at their default omitted).

    The service reads them back with its own `read_settings`, so what crosses the process boundary is
    the service's own typed settings object: a renamed field is a type error here, not a surprise at
    run time.
    """
    env = {}
    for field in msgspec.structs.fields(settings):
        value = getattr(settings, field.name)
        default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
        if value != default:
            builtin = msgspec.to_builtins(value)
            env[prefix + field.name.upper()] = builtin if isinstance(builtin, str) else json.dumps(builtin)
    return env


class LocalStack:
    """Start and stop the local deployment in dependency order."""

    def __init__(
        self,
        home: Path,
        ports: StackPorts | None = None,
        *,
        nats_url: str | None = None,
        nats_nodes: int = 1,
        nats_auth: bool = True,
    ) -> None:
        self.home = home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.ports = ports or StackPorts()
        self.supervisor = Supervisor(self.home)
        self.external_nats = nats_url
        self.nats_nodes = nats_nodes
        # An external NATS brings its own logins (in `nats_url`); ours are for the embedded one.
        self.nats_auth = nats_auth and not nats_url
        self.nats: NatsServer | NatsCluster | None = None
        self.vllm: VllmServer | None = None
        self.gateway_port = self.ports.gateway or free_port()

    @functools.cached_property
    def key_secret(self) -> str:
        """Signs episode keys (created when the local services first need it)."""
        return secret_file(self.home, "episode-key")

    @functools.cached_property
    def admin_token(self) -> str:
        """The local gateway's admin token."""
        return secret_file(self.home, "gateway-admin")

    @functools.cached_property
    def nats_credentials(self) -> dict[str, Credentials]:
        """Every NATS user's login (passwords created when the embedded server first needs them)."""
        return {
            user: Credentials(user=user, password=secret_file(self.home, f"nats-{user}")) for user in USERS
        }

    @property
    def nats_url(self) -> str:
        """Where the bus is, with the operator's login when NATS requires one."""
        return self.nats_url_of(ADMIN)

    def nats_url_of(self, user: str) -> str:
        """The bus URL a service (a `nats_permissions` user) connects with."""
        if self.external_nats:
            return self.external_nats
        if self.nats is None:
            raise RuntimeError("nats-server is not started")
        if not self.nats_auth:
            return self.nats.url
        return with_credentials(self.nats.url, self.nats_credentials[user])

    @property
    def _nats_users(self) -> dict[str, Credentials] | None:
        return self.nats_credentials if self.nats_auth else None

    @property
    def gateway_url(self) -> str:
        """The gateway's base URL (harnesses use `<url>/v1`)."""
        return f"http://127.0.0.1:{self.gateway_port}"

    def start_nats(self) -> None:
        """Start the embedded nats-server (or cluster) unless an external URL was given."""
        if self.external_nats:
            return
        if self.nats_nodes > 1:
            self._start_nats_cluster()
            return
        self.nats = NatsServer(
            self.home / "nats",
            port=self.ports.nats,
            log_file=self.home / "logs" / "nats-server.log",
            users=self._nats_users,
        )
        self.nats.start()

    def _start_nats_cluster(self) -> None:
        """Start the cluster (`--nats-port` P puts its nodes on P, P+1, ...) and lay out its streams.

        The streams are created replicated before any service starts, so no client that was not
        told the replica count (this process's readiness check) creates one with a single copy.
        """
        base = self.ports.nats
        cluster = NatsCluster(
            self.home / "nats-cluster",
            self.nats_nodes,
            ports=[base + i for i in range(self.nats_nodes)] if base else (),
            log_dir=self.home / "logs",
            users=self._nats_users,
        )
        self.nats = cluster
        cluster.start()
        try:
            asyncio.run(_lay_out_streams(self.nats_url, cluster.replicas))
        except BusError as exc:
            raise NatsServerError(f"the NATS cluster refused the streams: {exc}") from exc

    @property
    def nats_env(self) -> dict[str, str]:
        """What every service is told about the bus beyond its URL: the cluster's replica count."""
        if isinstance(self.nats, NatsCluster):
            return {REPLICAS_ENV: str(self.nats.replicas)}
        return {}

    def start_vllm(self, model_dir: Path) -> VllmServer:
        """Serve the policy with vLLM on the CPU: launched, not yet healthy (see `wait_vllm`).

        The trainer (which waits for its replicas) starts meanwhile; the gateway, which forwards to
        vLLM, after `wait_vllm`, and the reward service and controller after the gateway (episodes
        a controller resumes call the gateway at once).
        """
        self.vllm = VllmServer(
            model_dir,
            served_model_name=SERVED_MODEL,
            port=self.ports.vllm,
            max_model_len=4096,
            # Marks vLLM and its engine processes as this state folder's (as every service is).
            env={"HRL_HOME": str(self.home)},
            log_file=self.home / "logs" / "vllm.log",
        )
        self.vllm.launch()
        return self.vllm

    def wait_vllm(self) -> None:
        """Block until the launched vLLM serves (or raise `VllmServerError`); without one, return."""
        if self.vllm is not None:
            self.vllm.wait_ready()

    def _start(
        self, service: str, settings: msgspec.Struct, ready_url: str | None = None, *, ranks: int = 1
    ) -> None:
        """Start `python -m harnessrl.<service>`; with `ranks` > 1 under torchrun on this machine."""
        spec = ProcessSpec(
            name=service,
            argv=service_argv(service, ranks),
            env={
                "HRL_HOME": str(self.home),
                **self.nats_env,
                **settings_env(f"HRL_{service.upper()}_", settings),
            },
            ready_url=ready_url,
            url=self.gateway_url if service == "gateway" else "",
        )
        self.supervisor.start(spec)

    def start_gateway(self) -> None:
        """The gateway in front of the local vLLM replica (a run's sampling comes with its episodes)."""
        settings = GatewaySettings(
            nats_url=self.nats_url_of(GATEWAY),
            port=self.gateway_port,
            key_secret=self.key_secret,
            admin_token=self.admin_token,
            upstreams=[self.vllm.url] if self.vllm else [],
            served_model=SERVED_MODEL,
        )
        self._start("gateway", settings, ready_url=f"{self.gateway_url}/healthz")

    def start_reward(self, tasks_root: Path | None = None) -> None:
        """One reward worker; relative task repository paths resolve against `tasks_root`."""
        settings = RewardSettings(nats_url=self.nats_url_of(REWARD), tasks_root=str(tasks_root or "."))
        self._start("reward", local_sandbox(settings))

    def start_controller(self) -> None:
        """The controller, launching harnesses locally against our gateway."""
        settings = ControllerSettings(
            nats_url=self.nats_url_of(CONTROLLER),
            key_secret=self.key_secret,
            gateway_url=self.gateway_url,
            state_dir=str(self.home / "controller"),
        )
        self._start("controller", settings)

    def start_trainer(
        self, spec: RunSpec, model_dir: Path, *, ranks: int = 1, lr: float | None = None
    ) -> None:
        """The run's trainer, updating the local vLLM replica after every step.

        With `ranks` > 1 it trains data-parallel on that many processes (torchrun, gloo on the
        CPU): rank 0 runs the service, every rank trains a share of each step's rows. `lr` is the
        engine's learning rate (None: the trainer's default).
        """
        # The trainer shares the cores with vLLM: extra OpenMP threads only spin.
        engine = EngineSettings(torch_threads=1) if lr is None else EngineSettings(torch_threads=1, lr=lr)
        run_dir = self.home / "runs" / spec.run
        settings = TrainerSettings(
            nats_url=self.nats_url_of(TRAINER),
            run=spec.run,
            model_dir=str(model_dir),
            checkpoint_dir=str(run_dir / "checkpoints"),
            replicas=[self.vllm.url] if self.vllm else [],
            served_model=SERVED_MODEL,
            mode=spec.mode,
            staleness=spec.staleness,
            batch_groups=spec.batch_tasks,
            max_steps=spec.max_steps,
            tensorboard_dir=str(run_dir / "tensorboard"),
            engine=engine,
        )
        self._start("trainer", settings, ranks=ranks)

    def check(self) -> None:
        """Restart crashed services (raises when one keeps crashing)."""
        self.supervisor.check(on_crash=lambda name, _tail: log.warning("service.restarted", name=name))

    def stop(self) -> None:
        """Stop the controller, the harnesses it left running, the other services, vLLM, then NATS.

        The controller goes first: one still watching while the gateway stops would grade the
        harnesses' failed calls as the agent's failures (reward 0) and launch retries that fail too;
        stopped first, it leaves them to `end_harnesses`, and the next start retries those episodes.
        """
        self.supervisor.stop(["controller"])
        if ended := end_harnesses(self.home / "controller"):
            log.info("stack.harnesses_ended", count=ended)
        self.supervisor.stop()
        if self.vllm is not None:
            self.vllm.stop()
        if self.nats is not None:
            self.nats.stop()


async def _lay_out_streams(url: str, replicas: int) -> None:
    """Create every harnessrl stream at `replicas` on a freshly started cluster."""
    bus = NatsBus(url, name="harnessrl-stack", replicas=replicas)
    await bus.connect()
    try:
        await bus.ensure_streams()
    finally:
        await bus.close()
