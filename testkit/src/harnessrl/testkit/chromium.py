"""Debian's headless Chromium, driven over the DevTools protocol, for page tests.

`scripts/tools.sh` installs the `chromium` package. `Chromium` starts it headless with the flags
this machine needs as root (no sandbox, no GPU, no background networking: without those it floods
the closed network with refused connections), a fresh profile and `--remote-debugging-port=0`;
the port it picked is read from the profile's `DevToolsActivePort`. `Page` speaks the protocol over
one websocket (aiohttp): navigate, evaluate JavaScript, wait for a condition, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from harnessrl.shared.process import proc_stat, signal_group
from harnessrl.stack.spawn import spawn

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
)  # fmt: skip


class ChromiumError(RuntimeError):
    """Chromium is missing, didn't start, or a page command failed."""


def chromium_path() -> Path:
    """The Chromium binary (`scripts/tools.sh` installs Debian's `chromium`)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise ChromiumError("chromium is not installed: run scripts/tools.sh (apt-get install chromium)")


class Page:
    """One tab over the DevTools protocol."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self.console: list[str] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one protocol command and return its result (events met meanwhile are kept or dropped)."""
        call = next(self._ids)
        await self._socket.send_json({"id": call, "method": method, "params": params})
        while True:
            message = await self._socket.receive_json(timeout=60)
            if message.get("id") == call:
                if "error" in message:
                    raise ChromiumError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._note(message)

    def _note(self, event: dict[str, Any]) -> None:
        """Keep console errors and uncaught exceptions: a page test reports them."""
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.console.append(
                f"exception: {params['exceptionDetails'].get('text')} {params['exceptionDetails']}"
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning"):
            self.console.append(
                f"console {params['type']}: {[a.get('value') for a in params.get('args', [])]}"
            )

    async def goto(self, url: str) -> None:
        """Open `url` and wait for its load event."""
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise ChromiumError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Poll `expression` until it is truthy; its value, or `ChromiumError` naming it on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise ChromiumError(
                    f"timed out after {timeout_s}s waiting for {expression!r} (console: {self.console})"
                )
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (beyond the window) at `path`."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        return _write(path, base64.b64decode(shot["data"]))


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


class Chromium:
    """A headless Chromium process with a fresh profile; `page()` opens its first tab."""

    def __init__(self, *, width: int = 1440, height: int = 1000) -> None:
        self.width, self.height = width, height
        self.process: subprocess.Popen[bytes] | None = None
        self._profile = tempfile.TemporaryDirectory(prefix="harnessrl-chromium-")
        self.port = 0

    @property
    def profile(self) -> Path:
        """The fresh profile folder (removed by `stop`)."""
        return Path(self._profile.name)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start Chromium and wait until it says which port its DevTools listen on."""
        process = self._launch()
        deadline = time.monotonic() + timeout_s
        while (port := self._devtools_port()) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise ChromiumError(f"chromium did not start (exit {process.poll()}): {self._log_tail()}")
            await asyncio.sleep(0.05)
        self.port = port

    def _launch(self) -> subprocess.Popen[bytes]:
        profile = self.profile
        command = [
            str(chromium_path()), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
            f"--window-size={self.width},{self.height}", "about:blank",
        ]  # fmt: skip
        with (profile / "chromium.log").open("wb") as log:
            self.process = spawn(command, stdout=log, stderr=subprocess.STDOUT)
        return self.process

    def _devtools_port(self) -> int | None:
        """The port Chromium wrote into the profile's `DevToolsActivePort`, once it did."""
        active = self.profile / "DevToolsActivePort"
        text = active.read_text().strip() if active.exists() else ""
        return int(text.split()[0]) if text else None

    def _log_tail(self) -> str:
        return (self.profile / "chromium.log").read_text(errors="replace")[-2000:]

    @contextlib.asynccontextmanager
    async def page(self) -> AsyncIterator[Page]:
        """The first tab, with page and runtime events on."""
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.port}/json/list") as listing:
                targets = json.loads(await listing.text())
            url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
            async with session.ws_connect(url, max_msg_size=64 * 1024 * 1024) as socket:
                page = Page(socket)
                await page.send("Page.enable")
                await page.send("Runtime.enable")
                yield page

    def stop(self) -> None:
        """End Chromium and every process it started, then remove its profile.

        Chromium runs in a session of its own; its network, storage and renderer processes outlive
        the browser process by a moment and write into the profile meanwhile, so the profile goes
        only once none of them runs (SIGKILL after 10 s).
        """
        if self.process is not None:
            group = self.process.pid
            signal_group(group, signal.SIGTERM)
            _wait_group(group, timeout_s=10)
            signal_group(group, signal.SIGKILL)
            self.process.wait()
            _wait_group(group, timeout_s=10)
        self._profile.cleanup()


def group_running(group: int) -> list[int]:
    """The processes of process group `group` that still run (a zombie writes nothing: not counted)."""
    running = []
    for pid in (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()):
        fields = proc_stat(pid)  # None: it ended between listing and reading
        if fields is not None and int(fields[2]) == group and fields[0] not in ("Z", "X"):
            running.append(pid)
    return running


def _wait_group(group: int, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_running(group) and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.asynccontextmanager
async def chromium(*, width: int = 1440, height: int = 1000) -> AsyncIterator[Chromium]:
    """A started headless Chromium, stopped on exit."""
    browser = Chromium(width=width, height=height)
    try:
        await browser.start()
        yield browser
    finally:
        browser.stop()
