"""The model's chat template as the episode's vLLM replica applies it (`/tokenize`), for token-in mode.

A render is a call on the replica too (it takes one of its slots). A replica without `/tokenize`
(an OpenAI-compatible server that isn't vLLM) answers 404/405: `NoRender`, remembered per replica,
and token-in calls to it go plain.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from harnessrl.gateway.errors import BadGateway, Unavailable, error_for_status
from harnessrl.gateway.forwarding import NOT_REACHED, transport_error
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.upstreams import Upstream
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
# Render fields taken from the chat request (vLLM's `/tokenize` accepts them for messages).
_RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs")
# Two renders whose common end is the template's turn terminator (e.g. `<|im_end|>` `\n`).
_PROBE = [{"role": "user", "content": "a"}]
_PROBE_ANSWERED = [*_PROBE, {"role": "assistant", "content": "b"}]


class Renderer:
    """The model's chat template, applied by the episode's vLLM replica (`/tokenize`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.pool = gateway.pool
        settings = gateway.settings
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
        )
        self._terminators: dict[str, list[int]] = {}
        self._no_render: set[str] = set()  # replicas without `/tokenize` (not vLLM): calls go plain
        self.windows: dict[str, int] = {}  # each replica's max_model_len (its renders say it)

    async def render_anywhere(
        self, episode: str, body: dict[str, Any], messages: list[Any]
    ) -> tuple[Upstream, list[int]]:
        """The episode's first reachable replica and its render of the request (to be answered)."""
        unreachable: Exception | None = None
        for upstream in self.pool.candidates(episode):
            try:
                return upstream, await self.render(upstream, body, messages, generation_prompt=True)
            except _Unreachable as exc:  # nothing was sent: the next replica, as calls do
                upstream.failed(self.pool.unhealthy_after)
                unreachable = exc
        if unreachable is None:
            raise Unavailable("no healthy upstream", retry_after=5.0)
        raise Unavailable(f"no upstream reachable: {unreachable}", retry_after=2.0)

    async def render(
        self, upstream: Upstream, body: dict[str, Any], messages: list[Any], *, generation_prompt: bool
    ) -> list[int]:
        """Token ids of `messages` as the chat route would render them.

        NoRender when the replica has no `/tokenize` route (404/405: an OpenAI-compatible server
        that isn't vLLM); it is remembered, so only its first call asks.
        """
        if upstream.url in self._no_render:
            raise NoRender(upstream.url)
        request: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation_prompt}
        request.update({name: body[name] for name in _RENDER_FIELDS if body.get(name) is not None})
        try:
            async with upstream.slots, self.pool.session.post(  # a render is a call on the replica too
                upstream.url + "/tokenize", data=_encoder.encode(request),
                headers={"content-type": "application/json"}, timeout=self.timeout,
            ) as response:  # fmt: skip
                raw = await response.read()
                status = response.status
        except NOT_REACHED as exc:
            raise _Unreachable(f"upstream {upstream.url} unreachable: {type(exc).__name__}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise transport_error(upstream, exc) from exc
        if status in (404, 405):
            if upstream.url not in self._no_render:
                self._no_render.add(upstream.url)
                log.warning("token_in.no_render", upstream=upstream.url, status=status)
            raise NoRender(upstream.url)
        tokens, window = _tokens(status, raw)
        if window:
            self.windows[upstream.url] = window
        return tokens

    async def terminator(self, upstream: Upstream) -> list[int]:
        """What the template writes after each turn's text (learned once per replica)."""
        known = self._terminators.get(upstream.url)
        if known is None:
            asked = await self.render(upstream, {}, list(_PROBE), generation_prompt=False)
            answered = await self.render(upstream, {}, list(_PROBE_ANSWERED), generation_prompt=False)
            known = self._terminators[upstream.url] = answered[len(answered) - _suffix_len(asked, answered) :]
        return known


class _Unreachable(Unavailable):
    """The replica could not be connected to (the render never reached it)."""


class NoRender(Exception):
    """The replica has no `/tokenize` route: token-in can't render for it, the call goes plain."""


def _tokens(status: int, raw: bytes) -> tuple[list[int], int | None]:
    """A render's token ids and the replica's context window (`max_model_len`)."""
    try:
        data = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadGateway("the upstream answered an unreadable render") from exc
    if status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise error_for_status(status, str(message or "the upstream could not render the request"))
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list):
        raise BadGateway("the upstream answered a render without tokens")
    window = data.get("max_model_len")
    return tokens, window if isinstance(window, int) else None


def _suffix_len(left: list[int], right: list[int]) -> int:
    size = 0
    while size < min(len(left), len(right)) and left[-1 - size] == right[-1 - size]:
        size += 1
    return size
