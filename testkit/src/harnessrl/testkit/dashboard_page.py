"""`harnessrl dashboard` as a process, and the check that its page rendered in headless Chromium.

`render_check(nats_url, run, screenshot)` is the whole check for scripts (`make analytics-check`):
it starts `harnessrl dashboard --run RUN --port 0` on the bus, opens the page in Chromium, waits
until the reward curve, the episode states and a coloured token view are in the DOM, saves a
screenshot and returns True (False, with the reason logged, when the page never got there).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from harnessrl.shared.log import get_logger
from harnessrl.testkit.chromium import ChromiumError, Page, chromium

log = get_logger(__name__)

# True once the page shows the curves, the episodes' states and a coloured token view.
RENDERED = """(() => {
  const q = s => document.querySelectorAll(s).length;
  return q('#reward-chart path.curve') >= 1 && q('#heldout-chart path.curve') >= 1
    && q('#episodes-table .state-badge') >= 1 && q('#state-bar [data-state]') >= 1
    && q('#tokens .tok.trained') >= 1 && q('#tokens .tok.context') >= 1
    && document.getElementById('live-status').className === 'live';
})()"""


@contextlib.contextmanager
def dashboard_process(
    nats_url: str, run: str | None = None, *, tokenizer: Path | None = None, log_file: Path | None = None
) -> Iterator[str]:
    """`harnessrl dashboard` on a free port, for as long as the block runs; yields the page's URL."""
    command = [
        sys.executable,
        "-m",
        "harnessrl.stack.cli",
        "dashboard",
        "--nats-url",
        nats_url,
        "--port",
        "0",
    ]
    if run is not None:
        command += ["--run", run]
    if tokenizer is not None:
        command += ["--tokenizer", str(tokenizer)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_file.open("wb") if log_file else open(os.devnull, "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, env=env)
    try:
        line = process.stdout.readline().decode() if process.stdout else ""
        if not line.startswith("dashboard: "):
            raise ChromiumError(f"harnessrl dashboard did not start (exit {process.poll()}): {line!r}")
        yield line.removeprefix("dashboard: ").strip()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def open_rendered(page: Page, url: str, timeout_s: float = 30.0) -> None:
    """Open the dashboard at `url` and wait until it rendered (`RENDERED`)."""
    await page.goto(url)
    await page.wait_for(RENDERED, timeout_s)


async def page_rendered(url: str, screenshot: Path, timeout_s: float = 30.0) -> bool:
    """Whether the page at `url` renders in Chromium within `timeout_s`; a screenshot either way."""
    async with chromium() as browser, browser.page() as page:
        try:
            await open_rendered(page, url, timeout_s)
            return True
        except ChromiumError as exc:
            log.warning("dashboard.not_rendered", error=str(exc))
            return False
        finally:
            await page.screenshot(screenshot)


def render_check(
    nats_url: str, run: str, screenshot: Path, *, tokenizer: Path | None = None, timeout_s: float = 30.0
) -> bool:
    """Serve the dashboard of `run` from the bus at `nats_url` and check it renders in Chromium."""
    with dashboard_process(nats_url, run, tokenizer=tokenizer) as url:
        return asyncio.run(page_rendered(url, screenshot, timeout_s))
