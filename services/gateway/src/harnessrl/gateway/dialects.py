"""Per-API request rewriting and response capture: chat, completions, responses, messages.

Each `Api` knows, for its endpoint: which fields make vLLM return token ids and logprobs
(`prepare`), how to copy them out of a response body or a stream event into a `Capture`, and how
to remove them again when the client did not ask for them. Fields the gateway doesn't know pass
through untouched.
"""

from __future__ import annotations

from typing import Any, ClassVar

from harnessrl.gateway import responses
from harnessrl.gateway.anthropic import error_body, to_chat_request, to_message
from harnessrl.gateway.capture import Asked, Capture, content_logprobs, token_logprobs
from harnessrl.gateway.errors import Dialect
from harnessrl.shared.contracts import ApiKind


class Api:
    """Base: an OpenAI-dialect endpoint with nothing to inject."""

    kind: ClassVar[ApiKind] = "chat"
    dialect: ClassVar[Dialect] = "openai"
    path: ClassVar[str] = ""
    upstream_path: ClassVar[str] = ""

    def prepare(self, body: dict[str, Any]) -> Asked:
        """Inject capture fields into `body` (in place); return what the client asked itself."""
        return Asked()

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """Copy capture data out of a non-streamed response; return what the client gets."""
        return body

    def capture_event(self, event: str | None, data: dict[str, Any], asked: Asked, capture: Capture) -> bool:
        """Same for one stream event (mutated in place); False drops the event."""
        return True

    def is_final(self, event: str | None, data: bytes) -> bool:
        """Whether this stream event is the last one (held back until the span is published)."""
        return data == b"[DONE]"

    def upstream_error(self, status: int, raw: bytes) -> bytes:
        """An upstream's error body as the client gets it (the upstream speaks this API: as is)."""
        return raw


class ChatApi(Api):
    """`/v1/chat/completions`: ids at top level (prompt) and per choice, logprobs per token."""

    kind: ClassVar[ApiKind] = "chat"
    path = upstream_path = "/v1/chat/completions"

    def prepare(self, body: dict[str, Any]) -> Asked:
        """Ask for token ids, logprobs and (streaming) the usage chunk."""
        asked = Asked(
            token_ids=bool(body.get("return_token_ids")),
            logprobs=bool(body.get("logprobs")),
            usage=_stream_usage(body),
        )
        body["return_token_ids"] = True
        body["logprobs"] = True
        if body.get("stream"):
            _force_stream_usage(body)
        return asked

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """Read `prompt_token_ids`, choices' `token_ids` and `logprobs.content`."""
        capture.set_prompt(body.get("prompt_token_ids"))
        capture.set_usage(body.get("usage"))
        for choice in _choices(body):
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
            slot = capture.choice(choice.get("index"))
            slot.add(choice.get("token_ids"), content_logprobs(choice.get("logprobs")), text)
            slot.finish_reason = choice.get("finish_reason")
            _strip_choice(choice, asked, pop=False)
        if not asked.token_ids:
            body["prompt_token_ids"] = None
        return body

    def capture_event(self, event: str | None, data: dict[str, Any], asked: Asked, capture: Capture) -> bool:
        """Read one chunk; drop the usage-only chunk unless the client asked for usage."""
        if "prompt_token_ids" in data:
            capture.set_prompt(data["prompt_token_ids"])
            if not asked.token_ids:
                data["prompt_token_ids"] = None
        for choice in _choices(data):
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            slot = capture.choice(choice.get("index"))
            slot.add(choice.get("token_ids"), content_logprobs(choice.get("logprobs")), text)
            if choice.get("finish_reason") is not None:
                slot.finish_reason = choice["finish_reason"]
            _strip_choice(choice, asked, pop=True)
        usage = data.get("usage")
        if usage is not None:
            capture.set_usage(usage)
            if not asked.usage:
                if not data.get("choices"):
                    return False
                data.pop("usage")
        return True


class CompletionsApi(Api):
    """`/v1/completions`: prompt ids per choice, `logprobs.token_logprobs`."""

    kind: ClassVar[ApiKind] = "completions"
    path = upstream_path = "/v1/completions"

    def prepare(self, body: dict[str, Any]) -> Asked:
        """Ask for token ids, the sampled tokens' logprobs and (streaming) usage."""
        asked = Asked(
            token_ids=bool(body.get("return_token_ids")),
            logprobs=body.get("logprobs") is not None,
            usage=_stream_usage(body),
        )
        body["return_token_ids"] = True
        if body.get("logprobs") is None:
            body["logprobs"] = 0
        if body.get("stream"):
            _force_stream_usage(body)
        return asked

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """Read each choice's prompt ids, token ids and token logprobs."""
        capture.set_usage(body.get("usage"))
        for choice in _choices(body):
            self._capture_choice(choice, asked, capture, pop=False)
        return body

    def capture_event(self, event: str | None, data: dict[str, Any], asked: Asked, capture: Capture) -> bool:
        """Read one chunk; drop the usage-only chunk unless the client asked for usage."""
        for choice in _choices(data):
            self._capture_choice(choice, asked, capture, pop=True)
        usage = data.get("usage")
        if usage is not None:
            capture.set_usage(usage)
            if not asked.usage:
                if not data.get("choices"):
                    return False
                data.pop("usage")
        return True

    def _capture_choice(self, choice: dict[str, Any], asked: Asked, capture: Capture, *, pop: bool) -> None:
        if choice.get("index", 0) == 0:
            capture.set_prompt(choice.get("prompt_token_ids"))
        slot = capture.choice(choice.get("index"))
        slot.add(choice.get("token_ids"), token_logprobs(choice.get("logprobs")), choice.get("text"))
        if choice.get("finish_reason") is not None:
            slot.finish_reason = choice["finish_reason"]
        _strip_choice(choice, asked, pop=pop)
        if not asked.token_ids and "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None


class ResponsesApi(ChatApi):
    """`/v1/responses`, sent to vLLM's chat endpoint so that every sampled token is captured.

    vLLM's own Responses route drops the logprobs of function-call and reasoning turns (see
    `responses`); its chat route renders the same prompt and returns ids and logprobs for every
    token, so the call is captured there and answered as a Responses object or event stream.
    """

    kind: ClassVar[ApiKind] = "responses"
    path = "/v1/responses"
    upstream_path = "/v1/chat/completions"

    def prepare(self, body: dict[str, Any]) -> Asked:
        """Rewrite the Responses request as a chat request (in place), then inject as for chat."""
        include = body.get("include")
        asked = Asked(
            logprobs=isinstance(include, list) and responses.LOGPROBS_INCLUDE in include,
            response_messages=bool(body.get("enable_response_messages")),
            request=body.copy(),
        )
        hosted = responses.hosted_tools(body.get("tools"))
        if hosted:
            asked.left_out["hosted_tool"] = hosted
        chat = responses.to_chat_request(body)
        body.clear()
        body.update(chat)
        super().prepare(body)
        return asked

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """Capture the chat completion; answer the Responses object it is equivalent to."""
        super().capture_body(body, asked, capture)
        answer = responses.to_response(body, responses.Shape(asked.request or {}, logprobs=asked.logprobs))
        if asked.response_messages:
            first = capture.choices.get(0)
            answer["input_messages"] = [{"tokens": capture.prompt_ids or []}]
            answer["output_messages"] = [{"tokens": first.token_ids if first else []}]
        return answer


class MessagesApi(ChatApi):
    """`/v1/messages` (Anthropic), sent to vLLM's chat endpoint to capture ids (see `anthropic`)."""

    kind: ClassVar[ApiKind] = "messages"
    dialect: ClassVar[Dialect] = "anthropic"
    path = "/v1/messages"
    upstream_path = "/v1/chat/completions"

    def prepare(self, body: dict[str, Any]) -> Asked:
        """Rewrite the Messages request as a chat request (in place), then inject as for chat."""
        chat = to_chat_request(body)
        body.clear()
        body.update(chat)
        return super().prepare(body)

    def capture_body(self, body: dict[str, Any], asked: Asked, capture: Capture) -> dict[str, Any]:
        """Capture the chat completion; answer the Messages response it is equivalent to."""
        super().capture_body(body, asked, capture)
        return to_message(body, str(body.get("model", "")))

    def upstream_error(self, status: int, raw: bytes) -> bytes:
        """The chat error vLLM answered (OpenAI envelope), in Anthropic's envelope."""
        return error_body(raw, status)


def _stream_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _force_stream_usage(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}


def _choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def _strip_choice(choice: dict[str, Any], asked: Asked, *, pop: bool) -> None:
    if not asked.token_ids and "token_ids" in choice:
        if pop:
            del choice["token_ids"]
        else:
            choice["token_ids"] = None
    if not asked.logprobs:
        choice["logprobs"] = None


API_BY_PATH: dict[str, Api] = {
    api.path: api for api in (ChatApi(), CompletionsApi(), ResponsesApi(), MessagesApi())
}
