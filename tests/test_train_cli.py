"""`harnessrl train`: bad input gets a clear message, a deployment is only submitted to and followed,
and no process outlives the command (not even when it is killed with SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import WeightVersion, decode, decode_event, event_kind
from harnessrl.shared.net import free_port
from harnessrl.shared.runspec import load_run_spec
from harnessrl.stack.demo.tasks import task_spec, write_tasks
from harnessrl.stack.natsserver import NatsServer
from harnessrl.stack.train import TrainSession
from harnessrl.testkit import split_reward_harness

log = logging.getLogger(__name__)
CLI = str(Path(sys.executable).parent / "harnessrl")


def harnessrl(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [CLI, "train", *args, "--home", str(home)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)


def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, state: Callable[[], object] = lambda: ""
) -> float:
    """Poll until `condition` holds; returns the seconds it took. A timeout reports `state()`."""
    started = time.monotonic()
    while not condition():
        waited = time.monotonic() - started
        assert waited < timeout_s, f"timed out after {timeout_s} s waiting for {what}: {state()}"
        time.sleep(0.25)
    return time.monotonic() - started


def multiply_spec(
    tmp_path: Path, run: str, steps: int, command: list[str] | None = None, **extra: str
) -> Path:
    """A run on multiplication tasks, groups of 2, 2 tasks a step; by default every step trains.

    The default harness is the demo harness with a reward split inside each group
    (`harnessrl.testkit.split_reward_harness`): the tiny model is random, so on its own every group
    would score 0 and no step would train anything.
    """
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(a, 21) for a in range(10, 22)])
    lines = [f"{key} = {value}" for key, value in extra.items()]
    argv = command or split_reward_harness.COMMAND
    spec = tmp_path / f"{run}.toml"
    spec.write_text(
        f'run = "{run}"\ntasks = "tasks.jsonl"\ngroup_size = 2\nbatch_tasks = 2\nmax_steps = {steps}\n'
        'mode = "sync"\nstaleness = 0\n' + "".join(line + "\n" for line in lines) + "[launcher]\n"
        f'command = {json.dumps(argv)}\npreload = ["openai"]\n'
    )
    return spec


def orphans(home: Path) -> list[str]:
    """Processes still running that belong to this state folder."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if proc.pid != os.getpid() and (str(home) in cmdline or env.get("HRL_HOME") == str(home)):
            found.append(cmdline)
    return found


def cmdline_of(proc: psutil.Process) -> list[str]:
    """A process's command line; empty once it exited (a zombie or gone: it runs nothing to find)."""
    try:
        return proc.cmdline()
    except psutil.NoSuchProcess:  # ZombieProcess too
        return []


def tree_of(pid: int) -> list[psutil.Process]:
    """Every process started by `pid`, directly or not."""
    return psutil.Process(pid).children(recursive=True)


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def survivors(processes: list[psutil.Process]) -> list[str]:
    """Which of these processes still run (a reused pid is another process: psutil compares start times)."""
    alive = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(12, 34)])
    spec = tmp_path / "run.toml"
    spec.write_text(
        'run = "cli-test"\ntasks = "tasks.jsonl"\nmax_steps = 1\n[launcher]\ncommand = ["true"]\n'
    )
    return spec


def test_bad_spec_names_the_field(tmp_path: Path) -> None:
    write_tasks(tmp_path / "tasks.jsonl", [task_spec(12, 34)])
    bad = tmp_path / "bad.toml"
    bad.write_text('run = "x"\ntasks = "tasks.jsonl"\ngroup_sise = 4\n[launcher]\ncommand = ["true"]\n')
    done = harnessrl(str(bad), home=tmp_path / "home")
    assert done.returncode == 2
    assert "group_sise" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_missing_model_path(tmp_path: Path, spec_file: Path) -> None:
    done = harnessrl(str(spec_file), "--model", str(tmp_path / "nope"), home=tmp_path / "home")
    assert done.returncode == 1
    assert "model path" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_port_in_use(tmp_path: Path, spec_file: Path, tiny_model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = harnessrl(
            str(spec_file), "--model", str(tiny_model), "--gateway-port", str(port), home=tmp_path / "home"
        )
    assert done.returncode == 1
    assert f"gateway port {port} is already in use" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def test_nats_server_failing_to_start(tmp_path: Path, spec_file: Path, tiny_model: Path) -> None:
    broken = tmp_path / "nats-server"
    broken.write_text(
        '#!/bin/sh\n[ "$1" = "--version" ] && echo "nats-server: v2.15.1" && exit 0\n'
        'echo "fatal: JetStream store is corrupt" >&2; exit 1\n'
    )
    broken.chmod(0o755)
    env = {**os.environ, "HARNESSRL_NATS_SERVER": str(broken)}
    done = harnessrl(str(spec_file), "--model", str(tiny_model), home=tmp_path / "home", env=env)
    assert done.returncode == 1
    assert "nats-server exited" in done.stderr and "Traceback" not in done.stderr
    assert orphans(tmp_path / "home") == []


def ignore_sigint() -> None:
    """What a non-interactive shell does to its background jobs (`harnessrl up &` in a script)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_status_and_a_stop_signal_leave_nothing_behind(tmp_path: Path, stop: signal.Signals) -> None:
    """`up` stops in order on Ctrl-C, even started with SIGINT ignored, and on SIGTERM."""
    home = tmp_path / "home"
    cli = str(Path(sys.executable).parent / "harnessrl")
    up = subprocess.Popen(
        [cli, "up", "--home", str(home)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint,  # noqa: PLW1509 - the child runs nothing else before exec
    )
    try:
        status = None
        for _ in range(240):
            status = subprocess.run(
                [cli, "status", "--home", str(home)], capture_output=True, text=True, check=False
            )
            if status.returncode == 0 and all(
                name in status.stdout for name in ("gateway", "reward", "controller")
            ):
                break
            time.sleep(0.5)
        assert status is not None and status.returncode == 0, status
        assert "NO" not in status.stdout, status.stdout  # every recorded process is alive
    finally:
        up.send_signal(stop)
        _, said = up.communicate(timeout=60)
    assert up.returncode == 0 and "stopping" in said, said[-2000:]
    assert orphans(home) == []


def test_ctrl_c_leaves_a_resumable_run(tmp_path: Path, tiny_model: Path) -> None:
    spec = multiply_spec(tmp_path, "resume", 3)
    home = tmp_path / "home"
    cli = str(Path(sys.executable).parent / "harnessrl")
    argv = [cli, "train", str(spec), "--model", str(tiny_model), "--home", str(home)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = home / "runs" / "resume" / "checkpoints" / "resume"
    for _ in range(600):
        if (checkpoints / "latest").exists():
            break
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    first.wait(timeout=90)
    assert orphans(home) == []
    second = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    # Episodes the Ctrl-C cut short are retried, not graded: every step trains (a version each).
    run = json.loads((home / "runs" / "resume" / "summary.json").read_text())
    assert summary == {"run": "resume", "steps": 3, "version": 3}, (run["failures"], run["last_failure"])
    assert orphans(home) == []


def test_train_with_nats_url_only_submits_and_follows(tmp_path: Path, tiny_model: Path) -> None:
    """A deployment (`harnessrl up` with a trainer for the run) trains; `train --nats-url` starts nothing."""
    steps = 2
    spec = multiply_spec(tmp_path, "remote", steps, model=f'"{tiny_model}"')
    deployment, home = tmp_path / "deployment", tmp_path / "home"
    nats_port = free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    up_argv = [CLI, "up", "--home", str(deployment), "--nats-port", str(nats_port)]
    up_argv += ["--model", str(tiny_model), "--trainer", str(spec)]
    with (tmp_path / "up.log").open("w") as up_log:
        up = subprocess.Popen(up_argv, stdout=up_log, stderr=subprocess.STDOUT)
    try:
        trainer_log = deployment / "logs" / "trainer.log"
        waited = wait_for(
            lambda: up.poll() is None and "trainer.started" in read(trainer_log),
            300,
            "the deployment's trainer",
        )
        log.info("deployment up in %.1f s", waited)
        started = time.monotonic()
        train = subprocess.Popen(
            [CLI, "train", str(spec), "--nats-url", nats_url, "--home", str(home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children: set[str] = set()
        while train.poll() is None and time.monotonic() - started < 300:
            with contextlib.suppress(psutil.NoSuchProcess):
                children |= {" ".join(child.cmdline()) for child in tree_of(train.pid)}
            time.sleep(0.2)
        out, err = train.communicate(timeout=10)
        log.info("train --nats-url took %.1f s", time.monotonic() - started)
        assert train.returncode == 0, err[-3000:]
        assert children == set(), f"train --nats-url started processes: {children}"
        assert orphans(home) == []
        said = " ".join(err.split())  # rich wraps long lines
        assert "Traceback" not in said and "no trainer has subscribed" not in said
        assert "the deployment trains and serves its own model" in said  # the spec's `model` is not used
        assert json.loads(out.strip().splitlines()[-1]) == {"run": "remote", "steps": steps, "version": steps}
        run_dir = home / "runs" / "remote"
        assert (run_dir / "progress.png").stat().st_size > 10_000
        assert json.loads((run_dir / "summary.json").read_text())["run"] == "remote"
        assert not (home / "nats").exists() and not list(home.glob("logs/*"))  # no local services
        assert not list(home.glob("*.secret"))  # nor their secrets
        # What happened, read from the deployment's bus: the run's episodes, rollouts and versions.
        recorded = asyncio.run(bus_record(nats_url, "remote"))
        kinds = Counter(event_kind(decode_event(raw)) for raw in recorded["events"])
        episodes = steps * 2 * 2
        assert kinds["completed"] >= episodes and kinds["failed"] == 0, kinds
        assert len(recorded["rollouts"]) >= episodes
        versions = [decode(raw, WeightVersion).version for raw in recorded["weights"]]
        assert versions == list(range(1, steps + 1))
        assert (deployment / "runs" / "remote" / "checkpoints" / "remote" / "latest").exists()
        # Asking for more steps than the deployment's trainer makes ends at its last step, with an error.
        (tmp_path / "longer").mkdir()
        longer = multiply_spec(tmp_path / "longer", "remote", steps + 3, model=f'"{tiny_model}"')
        again = subprocess.run(
            [CLI, "train", str(longer), "--nats-url", nats_url, "--home", str(home)],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        said = " ".join(again.stderr.split())
        assert again.returncode == 1 and "Traceback" not in said, again.stderr[-3000:]
        assert f"stopped at step {steps} (its own max_steps), short of this spec's {steps + 3}" in said
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=90)
    assert up.returncode == 0, read(tmp_path / "up.log")[-3000:]
    assert orphans(deployment) == []


async def bus_record(url: str, run: str) -> dict[str, list[bytes]]:
    bus = NatsBus(url)
    await bus.connect()
    try:
        where = {
            "events": (subjects.EPISODES.name, subjects.episode_events_of_run(run)),
            "rollouts": (subjects.ROLLOUTS.name, subjects.rollout(run)),
            "weights": (subjects.WEIGHTS.name, subjects.weights(run)),
        }
        return {name: [d.data for d in await bus.replay(*args)] for name, args in where.items()}
    finally:
        await bus.close()


def test_train_with_nats_url_of_nothing_fails_fast(tmp_path: Path, spec_file: Path) -> None:
    started = time.monotonic()
    done = harnessrl(str(spec_file), "--nats-url", f"nats://127.0.0.1:{free_port()}", home=tmp_path / "home")
    took = time.monotonic() - started
    assert done.returncode == 1
    assert "cannot connect to NATS at" in " ".join(done.stderr.split()) and "Traceback" not in done.stderr
    assert took < 10, took
    assert orphans(tmp_path / "home") == []


def test_train_with_nats_url_refuses_local_only_options(tmp_path: Path, spec_file: Path) -> None:
    url = "nats://127.0.0.1:4222"
    done = harnessrl(str(spec_file), "--nats-url", url, "--model", str(tmp_path), home=tmp_path / "home")
    assert done.returncode == 2
    assert "--model only apply to local runs" in " ".join(done.stderr.split())


async def test_a_run_no_trainer_serves_gets_a_warning(
    tmp_path: Path, spec_file: Path, bus: NatsBus, nats_server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async def controller(_request: bytes) -> bytes:  # a deployment with a controller and no trainer
        return json.dumps({"ok": True, "run": "cli-test"}).encode()

    await bus.serve(subjects.control("controller", "submit"), controller)
    session = TrainSession(load_run_spec(spec_file), tmp_path / "home", nats_url=nats_server.url)
    following = asyncio.create_task(session.follow(live=False))
    said = ""
    try:
        for _ in range(100):
            said += capsys.readouterr().err
            if "no trainer has subscribed to run cli-test" in " ".join(said.split()) or following.done():
                break
            await asyncio.sleep(0.1)
        assert not following.done(), following  # it keeps following: a trainer may still start
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
    assert "no trainer has subscribed to run cli-test" in " ".join(said.split())
    assert session.stack.nats is None and not list((tmp_path / "home").glob("logs/*"))


def test_sigkill_of_train_leaves_no_process_behind(tmp_path: Path, tiny_model: Path) -> None:
    """Every service gets SIGTERM when `harnessrl train` dies, even by SIGKILL, and takes its children."""
    spec = multiply_spec(tmp_path, "killed", 50)
    home = tmp_path / "home"
    train = subprocess.Popen(
        [CLI, "train", str(spec), "--model", str(tiny_model), "--home", str(home)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tree: list[psutil.Process] = []
    try:
        episodes = home / "controller" / "runs" / "killed"
        waited = wait_for(
            lambda: train.poll() is None and any(episodes.glob("*/proc.json")), 300, "the first episodes"
        )
        log.info("stack up and episodes running after %.1f s", waited)
        tree = tree_of(train.pid)
        names = " ".join(" ".join(cmdline_of(proc)) for proc in tree)
        for service in ("nats-server", "vllm", "EngineCore", "gateway", "reward", "controller", "trainer"):
            assert service in names, f"{service} not running before the kill: {names}"
    finally:
        train.kill()  # SIGKILL: `harnessrl train` gets no chance to stop anything
        train.wait()
    took = wait_for(
        lambda: not survivors(tree) and not orphans(home),
        60,
        "every process of the run to exit",
        lambda: {"survivors": survivors(tree), "orphans": orphans(home)},
    )
    log.info("%d processes gone %.1f s after the SIGKILL", len(tree), took)


def flat(text: str) -> str:
    """Text without whitespace: rich wraps (and folds long words) at the terminal width."""
    return "".join(text.split())


def last_line(text: str) -> dict[str, object]:
    return dict(json.loads(text.strip().splitlines()[-1]))


def test_a_harness_that_cannot_start_stops_the_run_within_a_minute(tmp_path: Path, tiny_model: Path) -> None:
    """Every episode of the first group fails the same way: the run stops, and the command says why."""
    broken = ["sh", "-c", "echo cannot start >&2; exit 2"]
    spec = multiply_spec(tmp_path, "broken", 3, broken)
    home = tmp_path / "home"
    out, err = tmp_path / "train.out", tmp_path / "train.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        argv = [CLI, "train", str(spec), "--model", str(tiny_model), "--home", str(home)]
        train = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
    try:
        episodes = home / "controller" / "runs" / "broken"
        wait_for(
            lambda: train.poll() is not None or (episodes.is_dir() and any(episodes.iterdir())),
            300,
            "the first episode",
            lambda: read(err)[-2000:],
        )
        started = time.monotonic()
        train.wait(timeout=120)
        took = time.monotonic() - started
    finally:
        if train.poll() is None:
            train.kill()
    log.info("harnessrl train exited %.1f s after the first episode", took)
    said = read(err)
    assert train.returncode == 1, said[-3000:]
    assert took < 60, took
    summary = json.loads((home / "runs" / "broken" / "summary.json").read_text())
    stopped = summary["stopped"]
    assert stopped is not None, summary
    assert "cannot start" in stopped["detail"] and stopped["logs"] and stopped["episodes"] >= 2
    assert stopped["cause"] in said and flat(stopped["reason"]) in flat(said), said[-3000:]
    assert "cannot start" in said and flat(stopped["logs"]) in flat(said) and "Traceback" not in said
    assert "stopped" in summary["why"]
    # The failed episodes' rollouts may make one step (nothing to train: no model call) before the
    # stop lands; nothing is trained either way.
    ended = last_line(read(out))
    assert ended["run"] == "broken" and ended["version"] == 0 and ended["steps"] in (0, 1), ended
    assert summary["trained_steps"] == 0, summary
    assert (home / "runs" / "broken" / "progress.png").stat().st_size > 0
    assert orphans(home) == []


def test_a_run_that_trains_nothing_warns_and_fails_at_the_max_steps_flag(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Episodes that never call the model complete, but no step has a token to train on.

    The spec asks for 5 steps; `--max-steps 3` ends the run after 3.
    """
    spec = multiply_spec(tmp_path, "idle", 5, ["sh", "-c", "true"])
    home = tmp_path / "home"
    argv = [CLI, "train", str(spec), "--max-steps", "3", "--model", str(tiny_model), "--home", str(home)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    said = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stderr[-3000:]
    assert "warning: steps 1-3 (3 in a row) trained nothing" in said and "Traceback" not in said
    assert "nothing was trained: none of the 3 steps updated the policy" in said
    summary = json.loads((home / "runs" / "idle" / "summary.json").read_text())
    [warning] = summary["warnings"]
    assert (warning["first_step"], warning["last_step"]) == (1, 3) and sum(warning["counts"].values()) > 0
    assert summary["max_steps"] == 3 and summary["trained_steps"] == 0 and summary["stopped"] is None
    assert "nothing was trained" in summary["why"]
    assert all(reason in summary["why"] for reason in warning["counts"])
    assert last_line(done.stdout) == {"run": "idle", "steps": 3, "version": 0}
    assert (home / "runs" / "idle" / "progress.png").stat().st_size > 0
    assert orphans(home) == []


def test_max_steps_below_one_is_refused(tmp_path: Path, spec_file: Path) -> None:
    done = harnessrl(str(spec_file), "--max-steps", "0", home=tmp_path / "home")
    assert done.returncode == 2 and "--max-steps: must be 1 or more, not 0" in done.stderr
