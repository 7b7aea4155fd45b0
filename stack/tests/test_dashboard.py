"""`harnessrl dashboard` against a recorded run on the session's real nats-server, in headless Chromium.

One dashboard process (the real command, every run) serves the module; each test publishes its own
run through `harnessrl.testkit.recorded_run`, so none depends on another's messages.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harnessrl.shared.bus import NatsBus
from harnessrl.stack.natsserver import NatsServer
from harnessrl.testkit.chromium import chromium, group_running
from harnessrl.testkit.dashboard_page import RENDERED, dashboard_process, open_rendered, render_check
from harnessrl.testkit.recorded_run import RecordedRun, publish_recorded_run
from harnessrl.trainer.samples import build_rows


@pytest.fixture(scope="module")
def dashboard(
    nats_server: NatsServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The base URL of a `harnessrl dashboard` following every run on the session's bus."""

    async def streams() -> None:
        bus = NatsBus(nats_server.url)
        await bus.connect()
        await bus.ensure_streams()
        await bus.close()

    asyncio.run(streams())
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    with dashboard_process(nats_server.url, tokenizer=tiny_model, log_file=log) as url:
        yield url.split("/?")[0].rstrip("/")


async def recorded(bus: NatsBus, run: str, tiny_model: Path) -> RecordedRun:
    """A six-step run with five episodes still in flight."""
    return await publish_recorded_run(bus, run, tokenizer=tiny_model, steps=6, in_flight=5)


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def until_seen(base: str, run: RecordedRun) -> dict[str, Any]:
    """The run's summary once the dashboard has read all of it (it reads the bus as it comes)."""
    for _ in range(100):
        status, body = await get_json(f"{base}/api/runs/{run.run}/summary")
        if status == 200 and body["step"] == run.step and body["episodes"]["total"] == len(run.states):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"the dashboard never showed all of run {run.run}")


DOM_FACTS = """(() => {
  const all = s => [...document.querySelectorAll(s)];
  return {
    reward_points: all('#reward-chart circle[data-series="reward (mean)"]').length,
    heldout_curves: all('#heldout-chart path.curve').length,
    states: [...new Set(all('#episodes-table .state-badge').map(e => e.textContent))].sort(),
    bar_states: all('#state-bar [data-state]').map(e => e.dataset.state).sort(),
    trained_versions: [...new Set(all('#tokens .tok.trained').map(e => e.dataset.version))].sort(),
    masked_reasons: [...new Set(all('#tokens .tok.masked').map(e => e.dataset.reason))].sort(),
    context_tokens: all('#tokens .tok.context').length,
    trained_colour: getComputedStyle(document.querySelector('#tokens .tok.trained')).backgroundColor,
    masked_colour: getComputedStyle(document.querySelector('#tokens .tok.masked')).backgroundImage,
    step: document.getElementById('step-value').textContent,
    in_flight: document.querySelector('#stat-in-flight .value').textContent,
    forged: document.querySelector('#stat-forgery .value').textContent,
    calls: all('#tokens .call').length,
  };
})()"""


async def test_the_page_shows_curves_episode_states_and_tokens_coloured_by_mask_and_version(
    dashboard: str, bus: NatsBus, tiny_model: Path, tmp_path: Path
) -> None:
    run = await recorded(bus, "dash-page", tiny_model)
    await until_seen(dashboard, run)
    async with chromium(width=1440, height=1000) as browser, browser.page() as page:
        await open_rendered(page, f"{dashboard}/?run={run.run}&episode={run.showcase}")
        await page.wait_for(
            f"document.getElementById('token-episode').textContent.startsWith('{run.showcase}')"
        )
        facts = await page.evaluate(DOM_FACTS)
        shot = await page.screenshot(tmp_path / "dashboard.png")
        assert not page.console, page.console
    assert shot.stat().st_size > 10_000
    assert facts["reward_points"] == 6 and facts["heldout_curves"] == 2
    assert facts["step"] == "6" and facts["in_flight"] == "5"
    assert facts["forged"] == str(run.outcomes["forgery"]) != "0"  # grades the reward service called forged
    assert {"completed", "failed", "retried", "started", "scheduled"} <= set(facts["states"])
    assert {"completed", "failed", "started"} <= set(facts["bar_states"])
    # the showcase's first call was sampled a version behind and re-sent (a dead end)
    assert facts["trained_versions"] == ["4", "5"] and facts["masked_reasons"] == ["dead_end"]
    assert facts["calls"] == 3 and facts["context_tokens"] > 20
    assert facts["trained_colour"] != facts["masked_colour"] and "gradient" in facts["masked_colour"]


async def test_a_new_step_on_the_bus_shows_up_on_the_open_page_without_reload(
    dashboard: str, bus: NatsBus, tiny_model: Path, tmp_path: Path
) -> None:
    run = await recorded(bus, "dash-live", tiny_model)
    await until_seen(dashboard, run)
    async with chromium() as browser, browser.page() as page:
        await open_rendered(page, f"{dashboard}/?run={run.run}")
        await page.evaluate("window.__same_page = true")
        await run.publish_step(bus)
        await page.wait_for("document.getElementById('step-value').textContent === '7'")
        facts = await page.evaluate(DOM_FACTS)
        assert await page.evaluate("window.__same_page === true"), "the page reloaded"
        assert await page.evaluate(RENDERED)
        await page.screenshot(tmp_path / "after-step-7.png")
    assert facts["reward_points"] == 7


async def test_the_json_endpoints_say_what_was_published(
    dashboard: str, bus: NatsBus, tiny_model: Path
) -> None:
    run = await recorded(bus, "dash-json", tiny_model)
    summary = await until_seen(dashboard, run)
    assert [p["step"] for p in summary["steps"]] == [1, 2, 3, 4, 5, 6] and summary["version"] == 6
    assert [p["step"] for p in summary["heldout"]] == run.heldout_steps == [2, 4, 6]
    assert summary["episodes"]["by_state"] == dict(Counter(run.states.values()))
    assert summary["episodes"]["in_flight"] == 5 and summary["rewards"]["rollouts"] == run.counts["rollout"]
    assert [w["version"] for w in summary["weights"]] == [1, 2, 3, 4, 5, 6]
    assert summary["staleness"] == {"0": 9, "1": 3} and summary["tokens_per_s"]["sampled"] > 0
    assert summary["ignored"] == {}
    assert summary["gradings"] == dict(run.outcomes) and run.outcomes["forgery"] > 0

    status, listed = await get_json(f"{dashboard}/api/runs")
    assert status == 200 and run.run in [r["run"] for r in listed["runs"]]
    status, flying = await get_json(f"{dashboard}/api/runs/{run.run}/episodes?state=in_flight")
    assert status == 200 and sorted(e["episode"] for e in flying["episodes"]) == sorted(run.in_flight)

    for episode, spans in run.spans.items():
        status, view = await get_json(f"{dashboard}/api/runs/{run.run}/episodes/{episode}/tokens?spans=200")
        assert status == 200 and view["consistent"], view
        assert view["trained_tokens"] == build_rows(episode, spans)[1].trained_tokens
    reasons: Counter[str] = Counter()
    for episode in run.spans:
        _, view = await get_json(f"{dashboard}/api/runs/{run.run}/episodes/{episode}/tokens")
        reasons.update(
            t["reason"] for call in view["spans"] for t in call["completion"] if t["role"] == "masked"
        )
    assert {"dead_end", "missing_logprob", "unmodeled_sampling"} <= set(reasons)


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/api/runs/no-such-run/summary", 404, "no-such-run"),
        ("/api/runs/bad.run/summary", 400, "not a valid subject token"),
        ("/api/runs/dash-bad/episodes?state=bogus", 400, "expected one of"),
        ("/api/runs/dash-bad/episodes/dash-bad-s1-t0-a0/tokens?spans=0", 400, "spans"),
        ("/api/runs/dash-bad/episodes/dash-bad-s1-t0-a0/tokens?spans=many", 400, "spans"),
        ("/api/runs/dash-bad/episodes/no-such-episode/tokens", 404, "no span"),
        ("/api/runs/dash-bad/episodes/bad*episode/tokens", 400, "episode"),
        ("/api/runs/no-such-run/events", 404, "no-such-run"),
    ],
)
async def test_bad_parameters_get_a_clear_4xx(
    dashboard: str, bus: NatsBus, tiny_model: Path, path: str, status: int, says: str
) -> None:
    run = RecordedRun("dash-bad", tiny_model)
    await run.publish_step(bus)
    await until_seen(dashboard, run)
    got, body = await get_json(dashboard + path)
    assert got == status and body["status_code"] == status, body
    assert says in str(body.get("detail", "")) + str(body.get("extra", "")), body


def test_the_analytics_check_renders_a_recorded_run_and_not_an_empty_one(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    async def publish() -> None:
        bus = NatsBus(nats_server.url)
        await bus.connect()
        await bus.ensure_streams()
        await publish_recorded_run(bus, "dash-check", tokenizer=tiny_model, steps=3)
        await bus.close()

    asyncio.run(publish())
    assert render_check(nats_server.url, "dash-check", tmp_path / "check.png", tokenizer=tiny_model)
    assert (tmp_path / "check.png").stat().st_size > 10_000
    assert not render_check(nats_server.url, "dash-nothing", tmp_path / "empty.png", timeout_s=4.0)


async def test_chromium_stops_with_every_process_it_started_before_its_profile_goes(dashboard: str) -> None:
    """Chromium's storage and network processes outlive the browser process by a moment and write
    into the profile meanwhile: removing it then failed ("Directory not empty: 'Default'")."""
    for _ in range(3):
        async with chromium() as browser, browser.page() as page:
            await page.send("Page.navigate", url=f"{dashboard}/?run=dash-chromium")
            await page.send("Runtime.evaluate", expression="localStorage.setItem('k', 'v'.repeat(1e5))")
            group = browser.process.pid if browser.process else 0
            started = group_running(group)
            profile = browser.profile
        assert len(started) > 1, started  # the browser's own session holds its helpers
        assert group_running(group) == [], "a Chromium process outlived stop()"
        assert not profile.exists()
