"""The local launcher with real processes: success, failure, timeout, SIGTERM ignored, restart."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from harnessrl.controller.launchers.base import LaunchError
from harnessrl.controller.launchers.episode_logs import log_tail
from harnessrl.controller.launchers.local import STOPPED_WITH_DEPLOYMENT, LocalLauncher, end_harnesses
from harnessrl.controller.launchers.process import ProcessFacts, alive
from harnessrl.shared.contracts import DETAIL_CHARS, TaskSpec
from harnessrl.testkit.exits import ExitRecorder, launch_request


async def started(tmp_path: Path, exits: ExitRecorder, grace: float = 0.5) -> LocalLauncher:
    launcher = LocalLauncher("r1", tmp_path, kill_grace_s=grace)
    await launcher.start(exits)
    return launcher


async def test_success_captures_output_and_hides_controller_secrets(
    tmp_path: Path, exits: type[ExitRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HRL_CONTROLLER_KEY_SECRET", "do-not-leak")
    seen = exits()
    launcher = await started(tmp_path, seen)
    script = (
        'echo "key=$HARNESSRL_EPISODE_KEY secret=${HRL_CONTROLLER_KEY_SECRET:-none}"; pwd; '
        "echo 4 > answer.txt"
    )
    where = await launcher.launch(launch_request("e1", ["sh", "-c", script]))
    status = await seen.wait("e1")
    assert where.startswith("pid:")
    assert (status.outcome, status.exit_code) == ("exited", 0)
    folder = launcher.episode_dir("e1")
    out = (folder / "stdout.log").read_text()
    assert "key=hrl_secret-key secret=none" in out
    assert str(folder / "work") in out
    assert (folder / "work" / "answer.txt").read_text() == "4\n"
    assert json.loads((folder / "exit.json").read_text()) == {"exit_code": 0}
    assert await launcher.launch(launch_request("e1", ["sh", "-c", "exit 9"])) == where  # idempotent
    await launcher.close()


async def test_non_zero_exit(tmp_path: Path, exits: type[ExitRecorder]) -> None:
    seen = exits()
    launcher = await started(tmp_path, seen)
    await launcher.launch(launch_request("e2", ["sh", "-c", "echo oops >&2; exit 3"]))
    status = await seen.wait("e2")
    assert (status.outcome, status.exit_code) == ("exited", 3)
    assert "oops" in (launcher.episode_dir("e2") / "stderr.log").read_text()
    # The failure carries its stderr's tail and where its logs are, also when relisted.
    assert status.detail.startswith("oops") and status.logs == str(launcher.episode_dir("e2"))
    assert (await launcher.relist())["e2"] == status


def test_the_stderr_tail_is_whole_last_lines_within_the_limit(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("".join(f"line {n}\n" for n in range(5000)))
    tail = log_tail(log, limit=DETAIL_CHARS)
    assert len(tail) <= DETAIL_CHARS and tail.endswith("line 4999")
    assert tail.splitlines()[0].startswith("line ") and len(tail.splitlines()[0]) == len("line 4999")
    assert log_tail(tmp_path / "none.log") == ""


async def test_missing_harness_binary_exits_127(tmp_path: Path, exits: type[ExitRecorder]) -> None:
    seen = exits()
    launcher = await started(tmp_path, seen)
    await launcher.launch(launch_request("e3", ["/no/such/harness"]))
    assert (await seen.wait("e3")).exit_code == 127


async def test_timeout_stops_the_whole_process_group(tmp_path: Path, exits: type[ExitRecorder]) -> None:
    seen = exits()
    launcher = await started(tmp_path, seen)
    # The harness starts a grandchild: the deadline must stop it too.
    await launcher.launch(
        launch_request("e4", ["sh", "-c", "sleep 60 & echo $! > child.pid; wait"], timeout_s=1.0)
    )
    status = await seen.wait("e4")
    assert status.outcome == "timeout"
    child = int((launcher.episode_dir("e4") / "work" / "child.pid").read_text())
    assert (
        not alive(ProcessFacts(pid=child, start_ticks=0, deadline=0)) or not Path(f"/proc/{child}").exists()
    )


async def test_harness_ignoring_sigterm_is_killed(tmp_path: Path, exits: type[ExitRecorder]) -> None:
    seen = exits()
    launcher = await started(tmp_path, seen, grace=0.5)
    script = "trap '' TERM; echo armed; while true; do sleep 0.1; done"
    began = time.monotonic()
    await launcher.launch(launch_request("e5", ["sh", "-c", script], timeout_s=1.0))
    status = await seen.wait("e5", timeout=20)
    assert status.outcome == "timeout"
    assert time.monotonic() - began >= 1.0
    facts = json.loads((launcher.episode_dir("e5") / "proc.json").read_text())
    assert not alive(ProcessFacts(**facts))


async def test_restarted_launcher_adopts_running_and_reads_finished(
    tmp_path: Path, exits: type[ExitRecorder]
) -> None:
    before = exits()
    first = await started(tmp_path, before)
    await first.launch(launch_request("done", ["sh", "-c", "exit 5"]))
    await first.launch(launch_request("running", ["sh", "-c", "sleep 2; exit 0"]))
    await first.launch(launch_request("stuck", ["sh", "-c", "sleep 60"], timeout_s=2.5))
    await before.wait("done")
    await first.close()  # the controller "dies": nobody follows the processes any more

    seen = exits()
    second = await started(tmp_path, seen)
    listed = await second.relist()
    assert listed["done"] is not None and listed["done"].exit_code == 5
    assert listed["running"] is None and listed["stuck"] is None
    assert (await seen.wait("running")).exit_code == 0
    assert (await seen.wait("stuck")).outcome == "timeout"
    assert "done" not in seen.seen  # already finished before the restart: reported by relist only


async def test_a_stopping_deployment_ends_the_harnesses_a_closed_launcher_left(
    tmp_path: Path, exits: type[ExitRecorder]
) -> None:
    """Closing leaves harnesses for the next controller; `end_harnesses` ends them, children too."""
    seen = exits()
    launcher = await started(tmp_path, seen)
    script = "trap '' TERM; sleep 60 & echo $! > child.pid; while true; do sleep 0.1; done"
    for episode in ("e7", "e8"):
        await launcher.launch(launch_request(episode, ["sh", "-c", script], timeout_s=120))
    await launcher.close()
    folders = [launcher.episode_dir(e) for e in ("e7", "e8")]
    for folder in folders:
        while not (folder / "work" / "child.pid").exists():
            time.sleep(0.05)
    runners = [ProcessFacts(**json.loads((f / "proc.json").read_text())) for f in folders]
    assert all(alive(facts) for facts in runners)  # closing the launcher ends nothing
    assert end_harnesses(tmp_path, grace_s=0.5) == 2
    children = [int((f / "work" / "child.pid").read_text()) for f in folders]
    time.sleep(0.2)
    assert not any(alive(facts) for facts in runners)
    assert not any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in children)
    assert end_harnesses(tmp_path) == 0


async def test_harnesses_ended_with_the_deployment_are_retried_not_graded(
    tmp_path: Path, exits: type[ExitRecorder]
) -> None:
    """A harness the stopping stack ended (SIGTERM, its runner exits 143) reads as infra on restart.

    Graded as the agent's exit, it would be a reward-0 episode the agent never finished (a CI run's
    resumed training lost a step to it: the groups it interrupted had no reward variance).
    """
    launcher = await started(tmp_path, exits())
    await launcher.launch(launch_request("cut", ["sh", "-c", "exec sleep 60"], timeout_s=120))
    await launcher.close()
    folder = launcher.episode_dir("cut")
    while not (folder / "proc.json").exists():
        time.sleep(0.05)
    time.sleep(0.3)  # the runner has started the harness
    assert end_harnesses(tmp_path, grace_s=5) == 1
    assert json.loads((folder / "exit.json").read_text()) == {"exit_code": 143}
    status = (await (await started(tmp_path, exits())).relist())["cut"]
    assert status is not None
    assert (status.outcome, status.reason) == ("infra", STOPPED_WITH_DEPLOYMENT)


def _running(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


@pytest.mark.parametrize("base", ["--orphan=x", "-b evil", "HEAD~1", "main; touch /tmp/pwned"])
async def test_a_base_commit_that_is_not_a_commit_id_fails_the_launch_before_git_sees_it(
    tmp_path: Path, exits: type[ExitRecorder], base: str
) -> None:
    repo = tmp_path / "tasks" / "repos" / "r"
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "lib.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "add", "lib.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    launcher = LocalLauncher("r1", tmp_path / "runs", tasks_dir=tmp_path / "tasks")
    await launcher.start(exits())
    task = TaskSpec(
        task_id="i", kind="swe", prompt="fix", instance={"repo_path": "repos/r", "base_commit": base}
    )
    request = msgspec.structs.replace(launch_request("e9", ["true"]), task=task)
    with pytest.raises(LaunchError, match=r"base_commit .* is not a commit id"):
        await launcher.launch(request)
    work = launcher.episode_dir("e9") / "work"
    branches = subprocess.run(
        ["git", "-C", str(work), "branch", "--all"], capture_output=True, text=True, check=True
    )
    assert "x" not in branches.stdout.split() and "evil" not in branches.stdout
    await launcher.close()
