"""An aiohttp application served on a free local port: the test kit's recorders, sinks and fakes."""

from __future__ import annotations

from types import TracebackType

from aiohttp import web


class LocalApp:
    """Serves `app` on `host` (port 0: a free one) between `start` and `stop`, or as a context."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self._app, self._host, self._port = app, host, port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen; returns the base URL (no path)."""
        self._runner = web.AppRunner(self._app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self._host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.stop()
