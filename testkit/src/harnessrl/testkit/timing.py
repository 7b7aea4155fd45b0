"""Where the suite's time goes: the slowest tests and fixtures, set-up included, and their share.

Loaded by the harnessrl pytest plugin. Every session ends with two tables: the slowest tests
(set-up, call and teardown apart) and the slowest fixtures (servers, vLLM, models, images: set-up
plus teardown, over all their instances), each with its share of the summed test time. Under
pytest-xdist each worker times its own fixtures and hands them to the controller at its end, so the
tables cover every worker. `--times-json PATH` writes the whole table; `python -m
harnessrl.testkit.timing compare OLD NEW` sets two of them side by side (what `make test-times`
writes for comparing commits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import msgspec
import pytest

WORKER_KEY = "harnessrl_fixture_times"
SHOWN = 25


class TestTime(msgspec.Struct, kw_only=True):
    """One test's phases, in seconds (set-up includes the fixtures it started)."""

    nodeid: str
    setup_s: float = 0.0
    call_s: float = 0.0
    teardown_s: float = 0.0
    outcome: str = "passed"
    worker: str = ""

    @property
    def total_s(self) -> float:
        """Set-up, call and teardown together."""
        return self.setup_s + self.call_s + self.teardown_s


class FixtureTime(msgspec.Struct, kw_only=True):
    """One fixture definition's instances on one process: how many, and their set-up and teardown."""

    name: str
    scope: str
    where: str
    instances: int = 0
    setup_s: float = 0.0
    teardown_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Set-up and teardown together."""
        return self.setup_s + self.teardown_s


class Times(msgspec.Struct, kw_only=True):
    """The whole table of one session (the JSON `--times-json` writes)."""

    wall_s: float
    workers: int
    tests: list[TestTime]
    fixtures: list[FixtureTime]

    @property
    def tests_s(self) -> float:
        """Summed test time: the wall time times the workers, less their idle time."""
        return sum(t.total_s for t in self.tests)


class Recorder:
    """The plugin object: times phases (controller) and fixtures (every process that runs tests)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.tests: dict[str, TestTime] = {}
        self.fixtures: dict[tuple[str, str, str], FixtureTime] = {}
        self.teardown_started: dict[int, float] = {}
        self.workers: set[str] = set()

    def _fixture(self, fixturedef: pytest.FixtureDef[Any]) -> FixtureTime:
        where = fixturedef.baseid or getattr(fixturedef.func, "__module__", "") or "plugin"
        key = (fixturedef.argname, fixturedef.scope, where)
        if key not in self.fixtures:
            self.fixtures[key] = FixtureTime(name=key[0], scope=key[1], where=key[2])
        return self.fixtures[key]

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, Any, Any]:
        """Time one fixture instance's set-up, and arrange for its teardown to be timed."""
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            record = self._fixture(fixturedef)
            record.instances += 1
            record.setup_s += time.perf_counter() - started
            # Finalizers run last-in first-out: this one runs just before the fixture's own teardown.
            fixturedef.addfinalizer(lambda: self._teardown_starts(fixturedef))

    def _teardown_starts(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        self.teardown_started[id(fixturedef)] = time.perf_counter()

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        """The fixture's teardown is over (pytest calls this after its own finalizers)."""
        started = self.teardown_started.pop(id(fixturedef), None)
        if started is not None:
            self._fixture(fixturedef).teardown_s += time.perf_counter() - started

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record one phase of one test (on the controller, from whichever worker ran it)."""
        worker = getattr(report, "node", None)
        worker_id = getattr(worker, "gateway", None)
        nodeid = plain_id(report.nodeid)
        test = self.tests.setdefault(nodeid, TestTime(nodeid=nodeid))
        phase = report.when if report.when in ("setup", "teardown") else "call"  # "???": its worker crashed
        setattr(test, f"{phase}_s", getattr(test, f"{phase}_s") + report.duration)
        if worker_id is not None:
            test.worker = worker_id.id
            self.workers.add(worker_id.id)
        if report.failed or (report.when == "call" and report.outcome != "passed"):
            test.outcome = report.outcome

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not loaded
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """Merge a finished xdist worker's fixture times (it timed what ran in its process)."""
        for raw in getattr(node, "workeroutput", {}).get(WORKER_KEY, []):
            mine = FixtureTime(**raw)
            key = (mine.name, mine.scope, mine.where)
            total = self.fixtures.setdefault(key, FixtureTime(name=key[0], scope=key[1], where=key[2]))
            total.instances += mine.instances
            total.setup_s += mine.setup_s
            total.teardown_s += mine.teardown_s

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        """On a worker: hand its fixture times over (after the session fixtures' teardown)."""
        output = getattr(self.config, "workeroutput", None)
        if output is not None:
            output[WORKER_KEY] = [msgspec.to_builtins(f) for f in self.fixtures.values()]

    def times(self) -> Times:
        """The table so far, slowest first."""
        return Times(
            wall_s=time.monotonic() - self.started,
            workers=max(len(self.workers), 1),
            tests=sorted(self.tests.values(), key=lambda t: -t.total_s),
            fixtures=sorted(self.fixtures.values(), key=lambda f: -f.total_s),
        )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Print the summary table; write the whole one where `--times-json` says."""
        times = self.times()
        if not times.tests:
            return
        for line in table(times, SHOWN):
            terminalreporter.write_line(line)
        path = self.config.getoption("times_json")
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(_dump(times))))
            terminalreporter.write_line(f"whole table: {path}")


def plain_id(nodeid: str) -> str:
    """A test's id without the `@group` xdist's loadgroup appends to it."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def _dump(times: Times) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(times)
    data["tests_s"] = round(times.tests_s, 3)
    for row, test in zip(data["tests"], times.tests, strict=True):
        row["total_s"] = round(test.total_s, 3)
    for row, fixture in zip(data["fixtures"], times.fixtures, strict=True):
        row["total_s"] = round(fixture.total_s, 3)
    return data


def table(times: Times, shown: int) -> list[str]:
    """The end-of-session summary: wall time, the slowest tests and the slowest fixtures."""
    total = times.tests_s or 1.0
    lines = [
        f"==== where the time went: {len(times.tests)} tests, {times.tests_s:.0f} s of test time "
        f"on {times.workers} worker(s), {times.wall_s:.0f} s wall ====",
        f"{'total s':>8} {'share':>6} {'setup':>7} {'call':>7} {'teardown':>8}  test",
    ]
    for t in times.tests[:shown]:
        phases = f"{t.setup_s:7.1f} {t.call_s:7.1f} {t.teardown_s:8.1f}"
        lines.append(f"{t.total_s:8.1f} {t.total_s / total:6.1%} {phases}  {t.nodeid}")
    lines.append(f"{'total s':>8} {'share':>6} {'setup':>7} {'teardown':>8} {'n':>4}  fixture (scope, where)")
    for f in times.fixtures[:shown]:
        phases = f"{f.setup_s:7.1f} {f.teardown_s:8.1f} {f.instances:4d}"
        lines.append(f"{f.total_s:8.1f} {f.total_s / total:6.1%} {phases}  {f.name} ({f.scope}, {f.where})")
    return lines


def load(path: Path) -> Times:
    """A table `--times-json` wrote (the derived totals it also holds are recomputed)."""
    return msgspec.json.decode(path.read_bytes(), type=Times)


def by_file(times: Times) -> dict[str, float]:
    """Summed test time per test file."""
    files: dict[str, float] = defaultdict(float)
    for t in times.tests:
        files[t.nodeid.split("::")[0]] += t.total_s
    return files


def compare(old: Times, new: Times, shown: int = SHOWN) -> list[str]:
    """Two tables side by side: wall and test time, then the files whose time changed most."""
    lines = [f"{'':24}{'old':>10}{'new':>10}{'ratio':>8}"]
    for name, was, now in (("wall s", old.wall_s, new.wall_s), ("test time s", old.tests_s, new.tests_s)):
        lines.append(f"{name:24}{was:10.0f}{now:10.0f}{now / max(was, 1e-9):8.2f}")
    lines += [
        f"{'tests':24}{len(old.tests):10d}{len(new.tests):10d}",
        f"{'old s':>9}{'new s':>9}{'change':>9}  file",
    ]
    before, after = by_file(old), by_file(new)
    changes = sorted(before.keys() | after.keys(), key=lambda f: -abs(after.get(f, 0) - before.get(f, 0)))
    for name in changes[:shown]:
        was, now = before.get(name, 0.0), after.get(name, 0.0)
        lines.append(f"{was:9.1f}{now:9.1f}{now - was:+9.1f}  {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`compare OLD NEW`: two tables side by side; `show T`: one as the summary; `files T`: seconds per file.

    `files` writes what `harnessrl.testkit.parallel` orders the work by (`tests/file-times.json`).
    """
    parser = argparse.ArgumentParser(prog="python -m harnessrl.testkit.timing")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("show").add_argument("table", type=Path)
    sub.add_parser("files").add_argument("table", type=Path)
    both = sub.add_parser("compare")
    both.add_argument("old", type=Path)
    both.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "show":
        out = table(load(args.table), SHOWN)
    elif args.command == "files":
        seconds = {name: round(s, 1) for name, s in sorted(by_file(load(args.table)).items())}
        out = [json.dumps(seconds, indent=1)]
    else:
        out = compare(load(args.old), load(args.new))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--times-json PATH`."""
    parser.addoption("--times-json", default=None, help="write where the session's time went (JSON) here")


def pytest_configure(config: pytest.Config) -> None:
    """Time every session."""
    config.pluginmanager.register(Recorder(config), "harnessrl-timing")


if __name__ == "__main__":
    raise SystemExit(main())
