"""The episode runner: run the harness, collect its artifact, upload it through the gateway.

`python -m harnessrl.controller.episode_runner -- <harness command...>` runs inside the episode (a local
process group or a Job's pod). It holds no bus credentials: the artifact goes to the gateway's
`PUT /harnessrl/v1/artifact`, authorised by the episode's own key, and the gateway stores it. The
wrapper exits with the harness's exit code (128 + N when a signal N ended it).

Artifacts: for SWE tasks (`HARNESSRL_ARTIFACT=patch`) the work tree's `git add -A && git diff
--cached --binary <base>` where base is the commit checked out before the harness ran (so commits
and new files the harness made are included); for simple tasks the file `$HARNESSRL_WORKDIR/answer.txt`
(or `HARNESSRL_ANSWER_FILE`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import structlog

from harnessrl.shared.log import configure_logging, get_logger

_UPLOAD_ATTEMPTS = 3


def _log() -> structlog.typing.FilteringBoundLogger:
    return get_logger(__name__)


def git_base(workdir: Path) -> str | None:
    """The commit the work tree is at before the harness runs (None outside a git repo)."""
    if os.environ.get("HARNESSRL_ARTIFACT", "patch") != "patch":
        return None
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=workdir, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def collect_patch(workdir: Path, base: str) -> bytes:
    """Everything the harness changed since `base`, new files and binaries included."""
    subprocess.run(["git", "add", "-A"], cwd=workdir, capture_output=True, check=True)
    return subprocess.run(
        ["git", "diff", "--cached", "--binary", base],
        cwd=workdir,
        capture_output=True,
        check=True,
    ).stdout


def collect_answer(workdir: Path) -> bytes | None:
    """The answer file the harness wrote, if any."""
    path = Path(os.environ.get("HARNESSRL_ANSWER_FILE") or workdir / "answer.txt")
    try:
        return path.read_bytes()
    except OSError:
        return None


def upload(gateway: str, key: str, kind: str, data: bytes) -> dict[str, object] | None:
    """PUT the artifact to the gateway; a few retries on connection errors, never raises."""
    url = f"{gateway.rstrip('/')}/harnessrl/v1/artifact"
    headers = {"Authorization": f"Bearer {key}", "X-Artifact-Kind": kind}
    for attempt in range(_UPLOAD_ATTEMPTS):
        request = urllib.request.Request(url, data=data, headers=headers, method="PUT")  # noqa: S310 - gateway URL from our own env
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                answer: dict[str, object] = json.loads(response.read() or b"{}")
                return answer
        except urllib.error.HTTPError as exc:
            _log().error(
                "artifact.upload_refused", status=exc.code, body=exc.read()[:200].decode(errors="replace")
            )
            return None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            _log().warning("artifact.upload_failed", attempt=attempt, error=str(exc))
            time.sleep(0.5 * (attempt + 1))
    return None


def run_harness(command: list[str]) -> int:
    """Run the harness, forwarding SIGTERM/SIGINT to it; returns a shell-style exit code."""
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        _log().error("harness.start_failed", command=command[0], error=str(exc))
        return 127

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


def collect_and_upload(workdir: Path, base: str | None) -> None:
    """Collect the episode's artifact and send it to the gateway (skipped when there is none)."""
    kind = os.environ.get("HARNESSRL_ARTIFACT") or ("patch" if base else "answer")
    data = collect_patch(workdir, base) if kind == "patch" and base else collect_answer(workdir)
    gateway, key = os.environ.get("HARNESSRL_GATEWAY_URL"), os.environ.get("HARNESSRL_EPISODE_KEY")
    if not data or not gateway or not key:
        _log().info("artifact.skipped", kind=kind, size=len(data or b""))
        return
    stored = upload(gateway, key, kind, data)
    _log().info("artifact.uploaded" if stored else "artifact.lost", kind=kind, size=len(data))


def _configure_logging() -> None:
    """Log to `HARNESSRL_RUNNER_LOG` when set (local episodes), else stderr (the pod's log).

    Locally the harness's own stderr goes to its own file, and what the runner says after the
    harness ended (artifact collection) must not read as the harness's last words there.
    """
    path = os.environ.get("HARNESSRL_RUNNER_LOG")
    stream = Path(path).open("a", buffering=1) if path else None  # noqa: SIM115 - open for the process's life
    configure_logging("console", stream=stream, force=True)


def main(argv: list[str] | None = None, runner: Callable[[list[str]], int] = run_harness) -> int:
    """Entry point: returns the harness's exit code (`runner` starts it; the fork server swaps it)."""
    _configure_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        _log().error(
            "runner.usage", usage="python -m harnessrl.controller.episode_runner -- <harness command...>"
        )
        return 2
    workdir = Path(os.environ.get("HARNESSRL_WORKDIR") or Path.cwd())
    base = os.environ.get("HARNESSRL_BASE_COMMIT") or git_base(workdir)
    code = runner(args)
    try:
        collect_and_upload(workdir, base)
    except (OSError, subprocess.CalledProcessError) as exc:
        _log().error("artifact.collect_failed", error=str(exc))
    exit_file = os.environ.get("HARNESSRL_EXIT_FILE")
    if exit_file:
        Path(exit_file).write_text(json.dumps({"exit_code": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
