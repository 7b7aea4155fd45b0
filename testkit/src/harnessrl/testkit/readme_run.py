"""Running one README section the way its reader would, in a fresh copy of the repository.

Each `sh` block runs in its own `bash` (stopping at the first failing command) with this checkout's
`.venv/bin` first on PATH, so `harnessrl`, `python` and `pip` are ours. A background block starts
in its own process group, "a second terminal"; the section's next block waits for its ready text,
and when the section is over it gets Ctrl-C (SIGINT to its group), as its reader would press it.
See `harnessrl.testkit.readme` for the convention.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import msgspec

from harnessrl.testkit.readme import Block, Section, shorten

BASH = ["bash", "-e", "-o", "pipefail", "-c"]


class BlockRun(msgspec.Struct, kw_only=True):
    """What one block did: the command as run, its exit status and its output."""

    block: Block
    command: str
    returncode: int | None = None  # None: still running (background) or killed at its timeout
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    ready: bool = False  # background: its ready text appeared

    def tail(self, chars: int = 4000) -> str:
        """The end of its output, for a failure message."""
        status = f"$ {self.command}-- exit {self.returncode} after {self.seconds} s --"
        return f"{status}\n{self.stdout[-chars:]}\n{self.stderr[-chars:]}"


def copy_repository(root: Path, dest: Path) -> Path:
    """Copy what git would see of `root` (tracked and untracked, nothing ignored) to `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = root / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)
    return dest


def command_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    """This environment with `root/.venv/bin` first on PATH, plus the section's inputs.

    A `PATH` among the inputs goes before `.venv/bin` (a throwaway environment's `pip`, say).
    """
    first = [extra["PATH"]] if "PATH" in extra else []
    path = os.pathsep.join([*first, str(root / ".venv" / "bin"), os.environ.get("PATH", "")])
    return {**os.environ, **extra, "PATH": path}


def _stop_group(process: subprocess.Popen[str], grace_s: float) -> int | None:
    """Ctrl-C to the process group, then SIGKILL after `grace_s`; its exit status if it exited."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=wait_s)
            return code if sig == signal.SIGINT else None
    return None


class Background:
    """A background block: started in its own process group, output to a log file."""

    def __init__(self, run: BlockRun, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.run, self.log = run, log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [*BASH, run.command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
            )  # fmt: skip
        self.started = time.monotonic()

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait for its ready text; False if it exited or the time ran out first."""
        deadline = time.monotonic() + timeout_s
        while self.run.block.ready not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.run.returncode = self.process.poll()
                self.run.stdout = self.output()
                return False
            time.sleep(0.5)
        self.run.ready = True
        return True

    def interrupt(self, grace_s: float) -> None:
        """Ctrl-C; records how it exited."""
        self.run.returncode = _stop_group(self.process, grace_s)
        self.run.stdout = self.output()
        self.run.seconds = round(time.monotonic() - self.started, 1)


class SectionRun:
    """One README section run in a fresh copy of the repository (a context manager).

    Entering copies the repository, lets `prepare(copy)` put in place what the README says its
    reader already has (it returns the section's inputs, as environment variables), then runs the
    blocks in order, stopping at the first that fails. Inside the `with` the background blocks still
    run (a check can ask the deployment they started); leaving gives them Ctrl-C. `results` holds
    every block that ran, in order.
    """

    def __init__(
        self,
        section: Section,
        root: Path,
        workdir: Path,
        *,
        prepare: Callable[[Path], dict[str, str]] | None = None,
        max_steps: int | None = None,
        block_timeout_s: float = 420.0,
        stop_grace_s: float = 90.0,
    ) -> None:
        self.section, self.root, self.workdir = section, root, workdir
        self.prepare = prepare
        self.env = command_env(root, {})
        self.max_steps, self.block_timeout_s, self.stop_grace_s = max_steps, block_timeout_s, stop_grace_s
        self.results: list[BlockRun] = []
        self.backgrounds: list[Background] = []

    def command(self, block: Block) -> str:
        """The block's text, shortened where the README allows (`--max-steps`)."""
        return block.text if self.max_steps is None else shorten(block.text, self.max_steps)

    def __enter__(self) -> SectionRun:
        copy_repository(self.root, self.workdir)
        if self.prepare is not None:
            self.env = command_env(self.root, self.prepare(self.workdir))
        try:
            for block in self.section.blocks:
                if not self._run(block):
                    break
        except BaseException:
            self._stop_backgrounds()
            raise
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop_backgrounds()

    @property
    def ok(self) -> bool:
        """Every block ran: each foreground block exited 0, each background one became ready."""
        done = [r for r in self.results if (r.ready if r.block.background else r.returncode == 0)]
        return len(done) == len(self.section.blocks)

    def failure(self) -> str:
        """What went wrong, for an assertion message: the tail of every block that ran."""
        return "\n\n".join(r.tail() for r in self.results)

    def _run(self, block: Block) -> bool:
        run = BlockRun(block=block, command=self.command(block))
        self.results.append(run)
        if block.background:
            log = self.workdir.parent / f"{self.workdir.name}-background-{block.line}.log"
            background = Background(run, self.workdir, self.env, log)
            self.backgrounds.append(background)
            return background.wait_ready(self.block_timeout_s)
        started = time.monotonic()
        process = subprocess.Popen(
            [*BASH, run.command], cwd=self.workdir, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            run.stdout, run.stderr = process.communicate(timeout=self.block_timeout_s)
            run.returncode = process.returncode
        except subprocess.TimeoutExpired:
            _stop_group(process, 30.0)
            run.stdout, run.stderr = process.communicate()
            run.stderr += f"\n(killed after {self.block_timeout_s} s)"
        run.seconds = round(time.monotonic() - started, 1)
        return run.returncode == 0

    def _stop_backgrounds(self) -> None:
        for background in reversed(self.backgrounds):
            if background.run.returncode is None and background.process.poll() is None:
                background.interrupt(self.stop_grace_s)
            elif background.run.returncode is None:
                background.run.returncode = background.process.poll()
                background.run.stdout = background.output()
