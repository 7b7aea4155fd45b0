"""Token-in mode: a chat call's prompt is the episode's exact token history, not a re-render.

A chat template may render an earlier turn differently from how the model sampled it (reasoning
dropped, tool-call JSON re-serialised, whitespace changed, text tokenized the canonical way): then
the next prompt no longer extends the previous prompt + completion, and the trainer can't train
those turns as sampled. In token-in mode (per run: RunSpec `token_in`, else the gateway's
`token_in` setting) a chat, Messages or Responses call (Messages and Responses arrive here as chat)
is planned here instead:

1. Find the parent: the episode's span whose request + answer the request's earlier messages are
   (`conversation` digests on each span; `EpisodeSpans.conversation_parent`). Spans live on the
   bus, so a replica that doesn't know the newest reads the episode's spans again.
2. Render the request with vLLM's `/tokenize` (the model's own template), and the history up to
   the parent's answer; the new turns are what the full render has after as many turn ends
   (`terminator`, learned once per replica from two tiny renders) as the history has.
3. Prompt = parent prompt + parent completion (+ the end-of-turn bridge: what the template writes
   after the end-of-turn token, or the whole terminator if the completion stopped otherwise) +
   the new turns' ids. Sent as token ids to vLLM's `/v1/completions`, with `return_token_ids`.
4. The completions answer (or each stream chunk) is turned into the chat answer vLLM would give
   (`tool_parse.answer`: the `tool_parser` and `reasoning_parser` settings, vLLM's parser names),
   then into Messages or Responses as for any chat call.

Cases (`Span.token_in`, counted in `harnessrl_gateway_token_in_calls{case,reason}`): `extended` (the
whole sampled history spliced), `fresh` (the episode's first call, or no assistant turn in the
request), `branched` (the request has assistant turns no stored answer proves: the prompt is
spliced from the deepest parent that is proven, else the plain render). Calls token-in can't
reproduce go the plain chat way, counted as `plain` with the reason: `request` (a forced tool
choice, non-text content, `continue_final_message`), `api` (not chat-shaped: `/v1/completions`),
`no_render` (the replica has no `/tokenize`: an OpenAI-compatible server that isn't vLLM).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import msgspec

from harnessrl.gateway.capture import Asked, Capture
from harnessrl.gateway.conversation import TokenInCall, prefix_digests
from harnessrl.gateway.dialects import Api
from harnessrl.gateway.episode_spans import EpisodeSpans
from harnessrl.gateway.errors import Dialect
from harnessrl.gateway.recorder import CallRecord
from harnessrl.gateway.render import NoRender, Renderer
from harnessrl.gateway.service import Gateway
from harnessrl.gateway.tool_parse.answer import Answer, AnswerParser, AnswerStream
from harnessrl.gateway.upstreams import Upstream
from harnessrl.shared import subjects
from harnessrl.shared.contracts import ApiKind, TokenInCase
from harnessrl.shared.log import get_logger

log = get_logger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
# Chat request fields with no completions counterpart (the render consumed the conversation ones).
_CHAT_ONLY = frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs",
    "max_completion_tokens", "max_tokens", "stream_options", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "reasoning_effort", "include_reasoning",
    "thinking_token_budget", "return_token_ids", "documents", "mm_processor_kwargs",
    "media_io_kwargs", "user", "metadata", "store", "modalities", "audio", "prediction",
    "web_search_options", "functions", "function_call", "service_tier", "verbosity",
})  # fmt: skip


class TokenIn:
    """Plans token-in calls: which parent, which prompt, which upstream route."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.metrics = gateway.metrics
        self.renderer = Renderer(gateway)

    def enabled(self, run: str) -> bool:
        """Whether the run's calls go token-in (its spec, else the gateway's setting)."""
        return self.gateway.episodes.token_in(run, self.gateway.settings.token_in)

    async def plan(
        self, api: Api, call: CallRecord, spans: EpisodeSpans, body: dict[str, Any]
    ) -> tuple[Api, dict[str, Any]]:
        """The api and body to send: token-in ones, or `api` and `body` as they are (plain)."""
        wrapper = _WRAPPERS.get(api.kind)
        if wrapper is None or not isinstance(body.get("messages"), list):
            return self._plain("api", api, body)
        planned = await self.prompt(call, spans, body)
        if isinstance(planned, str):
            return self._plain(planned, api, body)
        upstream, prompt, call.token_in = planned
        self.metrics.token_in.labels(call.token_in.case, "").inc()
        sent = completions_body(body, prompt, self.renderer.windows.get(upstream.url))
        settings = self.gateway.settings
        parser = AnswerParser.for_request(body, settings.tool_parser, settings.reasoning_parser)
        if parser.tools is not None:  # as vLLM's chat route: tool markup may be special tokens
            sent["skip_special_tokens"] = False
        shaped = wrapper(api, call.token_in, parser=parser, top_logprobs=sent["logprobs"])
        return shaped, sent

    async def prompt(
        self, call: CallRecord, spans: EpisodeSpans, body: dict[str, Any]
    ) -> tuple[Upstream, list[int], TokenInCall] | str:
        """The replica, prompt ids and case a token-in call of this body sends; else why it goes plain."""
        if _plain_only(body):
            return "request"
        messages: list[Any] = body["messages"]
        try:
            digests = prefix_digests(messages)
        except RecursionError:  # nested too deep to digest: vLLM answers such a request itself
            return "request"
        try:
            upstream, full = await self.renderer.render_anywhere(call.episode, body, messages)
        except NoRender:
            return "no_render"
        case, prompt, parent = await self._prompt(call, spans, body, upstream, digests, full)
        return upstream, prompt, TokenInCall(case, digests[-1] if digests else "", parent)

    async def count(self, call: CallRecord, spans: EpisodeSpans, body: dict[str, Any]) -> int:
        """How many prompt tokens a call of this chat body sends upstream (`count_tokens`).

        The token-in prompt when the run goes token-in and the call would, else the chat render.
        NoRender when the replica can't render (no `/tokenize`).
        """
        if self.enabled(call.run):
            planned = await self.prompt(call, spans, body)
            if not isinstance(planned, str):
                return len(planned[1])
        _, full = await self.renderer.render_anywhere(call.episode, body, body["messages"])
        return len(full)

    def _plain(self, reason: str, api: Api, body: dict[str, Any]) -> tuple[Api, dict[str, Any]]:
        """The call goes the plain chat way, counted by why."""
        self.metrics.token_in.labels("plain", reason).inc()
        return api, body

    async def _prompt(
        self, call: CallRecord, spans: EpisodeSpans, body: dict[str, Any], upstream: Upstream,
        digests: list[str], full: list[int],
    ) -> tuple[TokenInCase, list[int], str | None]:  # fmt: skip
        """`(case, prompt, parent span)`."""
        messages: list[Any] = body["messages"]
        sampled = _answered_turns(messages)
        if sampled == 0:
            return "fresh", full, None
        found = spans.conversation_parent(digests[:sampled])
        if found is None or found[2] < sampled:  # another replica may have stored it
            await self._refresh(call, spans)
            found = spans.conversation_parent(digests[:sampled])
        if found is None:  # assistant turns, none sampled: few-shot examples when nothing was yet
            return ("fresh" if spans.next_seq == 0 else "branched"), full, None
        parent, context, turns = found
        history = await self.renderer.render(upstream, body, messages[:turns], generation_prompt=False)
        spliced = splice(context, history, full, await self.renderer.terminator(upstream))
        if spliced is None:
            log.warning("token_in.splice_failed", span=call.span_id, parent=parent)
            return "branched", full, None
        return ("extended" if turns == sampled else "branched"), spliced, parent

    async def _refresh(self, call: CallRecord, spans: EpisodeSpans) -> None:
        """Read the episode's stored spans again (another replica may have served its last call)."""
        stored = await self.gateway.bus.replay(subjects.SPANS.name, subjects.span(call.run, call.episode))
        async with spans.lock:
            spans.rebuild(stored)


def splice(
    context: list[int], history: list[int], full: list[int], terminator: list[int]
) -> list[int] | None:
    """Parent context + bridge + the new turns of `full`; None when the renders don't line up.

    `history` renders the conversation up to the parent's answer, `full` the whole request: the
    new turns start after as many terminators in `full` as `history` has.
    """
    if not context or not terminator or history[-len(terminator) :] != terminator:
        return None
    start = _after_nth(full, terminator, _count(history, terminator))
    if start is None or start >= len(full):
        return None
    bridge = terminator[1:] if context[-1] == terminator[0] else terminator
    return [*context, *bridge, *full[start:]]


def _count(ids: list[int], pattern: list[int]) -> int:
    count, at = 0, _find(ids, pattern, 0)
    while at is not None:
        count += 1
        at = _find(ids, pattern, at + len(pattern))
    return count


def _after_nth(ids: list[int], pattern: list[int], n: int) -> int | None:
    """The index just after the `n`-th (non-overlapping) occurrence of `pattern` (0: the start)."""
    end = 0
    for _ in range(n):
        at = _find(ids, pattern, end)
        if at is None:
            return None
        end = at + len(pattern)
    return end


def _find(ids: list[int], pattern: list[int], start: int) -> int | None:
    first, size = pattern[0], len(pattern)
    for at in range(start, len(ids) - size + 1):
        if ids[at] == first and ids[at : at + size] == pattern:
            return at
    return None


def _answered_turns(messages: list[Any]) -> int:
    """How many leading messages end with the last assistant turn (0: none was sampled)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return index + 1
    return 0


def _plain_only(body: dict[str, Any]) -> bool:
    """Requests token-in can't reproduce: vLLM's chat route shapes their output itself."""
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):  # vLLM constrains these to the JSON
        return True
    if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
        return True
    return any(_has_media(message) for message in body["messages"])


def _has_media(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") not in (None, "text") for part in content
    )


def completions_body(body: dict[str, Any], prompt: list[int], window: int | None) -> dict[str, Any]:
    """The chat request as a completions request of token ids (sampling parameters kept).

    Without a client limit the answer may fill the rest of the context window (`window`), as on
    vLLM's chat route; completions would stop at 16 tokens.
    """
    out = {name: value for name, value in body.items() if name not in _CHAT_ONLY}
    out["prompt"] = prompt
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    out["max_tokens"] = limit or (max(window - len(prompt), 1) if window else None)
    top = body.get("top_logprobs")
    out["logprobs"] = top if body.get("logprobs") and isinstance(top, int) else 0
    out["return_token_ids"] = True
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    return out


class TokenInApi(Api):
    """A chat-shaped call sampled through `/v1/completions`: answers converted back to chat.

    One per call (a stream's tool-call parsing is stateful); `inner` (the call's own api) then
    captures the chat answer and shapes it for the client, exactly as in plain mode.
    """

    upstream_path = "/v1/completions"

    def __init__(self, inner: Api, call: TokenInCall, *, parser: AnswerParser, top_logprobs: int) -> None:
        self.inner = inner
        self.call = call
        self.parser = parser
        self.top_logprobs = top_logprobs
        self._choices: dict[int, AnswerStream] = {}

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """The completions answer as chat, captured and shaped by the call's own api."""
        return self.inner.capture_body(self._answer(body), asked, capture)

    def capture_event(self, event: str | None, data: dict[str, Any], asked: Asked, capture: Capture) -> bool:
        """A completions chunk turned (in place) into a chat chunk, then handled as one."""
        if "choices" in data or "usage" in data:
            chunk = self._chunk(data)
            data.clear()
            data.update(chunk)
        return self.inner.capture_event(event, data, asked, capture)

    def is_final(self, event: str | None, data: bytes) -> bool:
        """As the call's own api."""
        return self.inner.is_final(event, data)

    def upstream_error(self, status: int, raw: bytes) -> bytes:
        """As the call's own api (vLLM's completions errors are chat's envelope)."""
        return self.inner.upstream_error(status, raw)

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        choices = [c for c in body.get("choices") or [] if isinstance(c, dict)]
        out = []
        for choice in choices:
            text = str(choice.get("text") or "")
            answer = self.parser.parse(text)
            message, calls = _message(answer), answer.tool_calls
            if choice.get("index", 0) == 0:
                self.call.answer = message
            out.append({
                "index": choice.get("index", 0),
                "message": message,
                "logprobs": chat_logprobs(choice.get("logprobs"), self.top_logprobs),
                "finish_reason": "tool_calls" if calls else choice.get("finish_reason"),
                "token_ids": choice.get("token_ids"),
            })  # fmt: skip
        return {
            "id": _chat_id(body.get("id")),
            "object": "chat.completion",
            "created": body.get("created") or int(time.time()),
            "model": body.get("model"),
            "choices": out,
            "usage": body.get("usage"),
            "prompt_token_ids": choices[0].get("prompt_token_ids") if choices else None,
        }

    def _chunk(self, data: dict[str, Any]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": _chat_id(data.get("id")),
            "object": "chat.completion.chunk",
            "created": data.get("created") or int(time.time()),
            "model": data.get("model"),
            "choices": [],
        }
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("prompt_token_ids") is not None and "prompt_token_ids" not in chunk:
                chunk["prompt_token_ids"] = choice["prompt_token_ids"]
            chunk["choices"].append(self._delta(choice))
        if data.get("usage") is not None:
            chunk["usage"] = data["usage"]
        return chunk

    def _delta(self, choice: dict[str, Any]) -> dict[str, Any]:
        index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
        state = self._choices.get(index)
        delta: dict[str, Any] = {}
        if state is None:
            state = self._choices[index] = self.parser.stream()
            delta["role"] = "assistant"
        finish = choice.get("finish_reason")
        reasoning, content, calls = state.feed(str(choice.get("text") or ""), done=finish is not None)
        if reasoning:
            delta["reasoning"] = reasoning
        if content or "role" in delta:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish is not None:
            finish = "tool_calls" if state.calls else finish
            if index == 0:
                self.call.answer = _message(state.answer())
        return {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(choice.get("logprobs"), self.top_logprobs),
            "finish_reason": finish,
            "token_ids": choice.get("token_ids"),
        }


def _message(answer: Answer) -> dict[str, Any]:
    """A parsed answer as vLLM's chat message (`reasoning` is vLLM 0.31's field name)."""
    return {
        "role": "assistant",
        "content": answer.content,
        "reasoning": answer.reasoning,
        "tool_calls": answer.tool_calls,
    }


def chat_logprobs(logprobs: Any, top_logprobs: int) -> dict[str, Any] | None:
    """A completions `logprobs` object (`tokens`, `token_logprobs`) as chat's `{"content": [...]}`.

    Completions' `top_logprobs` hold the sampled token besides the top ones: chat keeps the top ones.
    """
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content = []
    for at, (token, value) in enumerate(zip(tokens, values, strict=False)):
        top = tops[at] if at < len(tops) and isinstance(tops[at], dict) else {}
        content.append({
            "token": token,
            "logprob": value,
            "bytes": list(str(token).encode()),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, v in sorted(top.items(), key=lambda item: -item[1])[:top_logprobs]
            ],
        })  # fmt: skip
    return {"content": content}


def _chat_id(completion_id: Any) -> str:
    text = str(completion_id or "")
    return "chatcmpl-" + text.removeprefix("cmpl-")


class _TokenInChat(TokenInApi):
    kind: ClassVar[ApiKind] = "chat"
    path = "/v1/chat/completions"


class _TokenInResponses(TokenInApi):
    kind: ClassVar[ApiKind] = "responses"
    path = "/v1/responses"


class _TokenInMessages(TokenInApi):
    kind: ClassVar[ApiKind] = "messages"
    dialect: ClassVar[Dialect] = "anthropic"
    path = "/v1/messages"


_WRAPPERS: dict[ApiKind, type[TokenInApi]] = {
    "chat": _TokenInChat,
    "responses": _TokenInResponses,
    "messages": _TokenInMessages,
}
