"""`harnessrl dashboard`: a web page of a run, live from the bus.

A Litestar app reads every stream through `harnessrl tail`'s `Tail` (from the start, filtered by
`--run` when given) into a `Board`, and serves:

    GET /                                              the page (static HTML, plain JS, no CDN)
    GET /api/runs                                      the runs seen, and the one the page opens
    GET /api/runs/{run}/summary                        curves, episodes by state, staleness, rates, weights
    GET /api/runs/{run}/episodes?state=in_flight       episodes (all, in_flight, done or a lifecycle kind)
    GET /api/runs/{run}/episodes/{episode}/tokens?spans=8   the last calls' tokens, marked as trained
    GET /api/runs/{run}/events                         the summary again on every change (Server-Sent Events)

Errors are Litestar's JSON (`{"status_code", "detail"}`): 400 for a malformed run, episode or
query value, 404 for a run or episode the bus has nothing of.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from importlib import resources
from typing import Annotated, Any

import msgspec
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.params import Parameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from harnessrl.shared import subjects
from harnessrl.shared.bus import NatsBus
from harnessrl.shared.contracts import ContractError, Span
from harnessrl.shared.net import probe_nats
from harnessrl.shared.tokens import TokenDeltaError
from harnessrl.stack.dashboard.state import Board, RunBoard
from harnessrl.stack.dashboard.tokens import Decode, episode_tokens, id_decoder
from harnessrl.stack.tail import Selection, Tail

EPISODE_STATES = ("all", "in_flight", "done", "scheduled", "started", "agent_exited", "scored", "completed",
                  "failed", "retried", "sampling")  # fmt: skip
# Summaries sent to one page at most this often, however fast the bus goes.
SSE_MIN_INTERVAL_S = 0.25
# A comment line keeps an idle event stream open through proxies.
SSE_KEEPALIVE_S = 15.0


class DashboardError(RuntimeError):
    """The dashboard can't serve; the message is meant for a person."""


class Dashboard(msgspec.Struct, kw_only=True):
    """What the app reads from: the bus, the board it keeps, how token ids become text."""

    nats_url: str
    run: str | None = None
    tokenizer: str | None = None


def _token(value: str, what: str) -> str:
    """A run or episode id from the path; a malformed one is a 400 naming it."""
    try:
        return subjects.token(value)
    except ValueError as exc:
        raise ValidationException(detail=f"{what}: {exc}") from None


def _board(state: State, run: str) -> RunBoard:
    board: Board = state.board
    found = board.runs.get(_token(run, "run"))
    if found is None:
        raise NotFoundException(detail=f"run {run!r}: nothing of it is on the bus")
    return found


@get("/", media_type="text/html", include_in_schema=False)
async def page() -> str:
    """The dashboard page."""
    return resources.files("harnessrl.stack.dashboard").joinpath("static/index.html").read_text()


@get("/api/runs")
async def runs(state: State) -> dict[str, Any]:
    """The runs seen, newest first, and the run the page opens (`--run`, else the newest)."""
    board: Board = state.board
    listed = board.run_list()
    default = state.dashboard.run or (listed[0]["run"] if listed else None)
    return {"runs": listed, "default": default, "ignored": dict(board.ignored)}


@get("/api/runs/{run:str}/summary")
async def summary(state: State, run: str) -> dict[str, Any]:
    """Everything the page shows about `run`."""
    return _board(state, run).summary()


@get("/api/runs/{run:str}/episodes")
async def episodes(
    state: State, run: str, episode_state: Annotated[str, Parameter(query="state")] = "all"
) -> dict[str, Any]:
    """The run's episodes in a state, newest first."""
    board = _board(state, run)
    if episode_state not in EPISODE_STATES:
        raise ValidationException(
            detail=f"state {episode_state!r}: expected one of {', '.join(EPISODE_STATES)}"
        )
    rows = board.episode_rows(episode_state)
    return {"run": board.run, "state": episode_state, "episodes": [msgspec.to_builtins(r) for r in rows]}


@get("/api/runs/{run:str}/episodes/{episode:str}/tokens")
async def tokens(
    state: State, run: str, episode: str, spans: Annotated[int, Parameter(ge=1, le=200)] = 8
) -> Response[bytes]:
    """The episode's last `spans` calls, every token marked as the trainer would train it."""
    board = _board(state, run)
    episode = _token(episode, "episode")
    bus: NatsBus = state.bus
    stored = await bus.replay(subjects.SPANS.name, subjects.span(board.run, episode))
    if not stored:
        raise NotFoundException(detail=f"episode {episode!r} of run {board.run!r} has no span on the bus")
    decode: Decode = state.decode
    try:
        view = episode_tokens(board.run, episode, [d.decode(Span) for d in stored], decode, last=spans)
    except (ContractError, TokenDeltaError) as exc:
        raise HTTPException(
            status_code=502, detail=f"episode {episode!r}: its spans can't be read: {exc}"
        ) from exc
    return Response(msgspec.json.encode(view), media_type="application/json")


@get("/api/runs/{run:str}/events")
async def events(state: State, run: str) -> ServerSentEvent:
    """The run's summary now and after every change (event `summary`), a comment when idle."""
    board = _board(state, run)
    changes: Board = state.board

    async def stream() -> AsyncIterator[ServerSentEventMessage]:
        seen = -1
        while True:
            now = await changes.wait_change(seen, SSE_KEEPALIVE_S)
            if now == seen:
                yield ServerSentEventMessage(comment="idle")
                continue
            seen = now
            yield ServerSentEventMessage(event="summary", data=msgspec.json.encode(board.summary()).decode())
            await asyncio.sleep(SSE_MIN_INTERVAL_S)

    return ServerSentEvent(stream())


def create_app(dashboard: Dashboard) -> Litestar:
    """The app; on start it connects to the bus and follows every stream into the board."""

    @contextlib.asynccontextmanager
    async def follow_bus(app: Litestar) -> AsyncIterator[None]:
        bus = NatsBus(dashboard.nats_url, name="harnessrl-dashboard")
        await bus.connect()
        board = Board()
        if dashboard.run:
            board.runs[dashboard.run] = RunBoard(dashboard.run)
        tail = Tail(bus, Selection(run=dashboard.run, from_start=True))
        await tail.start()

        async def pump() -> None:
            async for entry in tail.entries():
                await board.observe(entry)

        task = asyncio.create_task(pump(), name="dashboard-pump")
        app.state.update(dashboard=dashboard, bus=bus, board=board, decode=id_decoder(dashboard.tokenizer))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await tail.stop()
            await bus.close()

    return Litestar(
        route_handlers=[page, runs, summary, episodes, tokens, events], lifespan=[follow_bus], debug=False
    )


async def serve(dashboard: Dashboard, host: str, port: int) -> None:
    """Serve the dashboard until cancelled; prints its URL first (`--port 0` picks a free port)."""
    import uvicorn

    await probe_nats(dashboard.nats_url, timeout_s=3.0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(create_app(dashboard), log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():  # noqa: ASYNC110 (uvicorn has no started event)
        await asyncio.sleep(0.05)
    if not server.started:
        await serving
        raise DashboardError(
            "the dashboard did not start (its bus or streams are not there; see the log above)"
        )
    path = f"/?run={dashboard.run}" if dashboard.run else "/"
    sys.stdout.write(f"dashboard: http://{host}:{sock.getsockname()[1]}{path}\n")
    sys.stdout.flush()
    await serving
