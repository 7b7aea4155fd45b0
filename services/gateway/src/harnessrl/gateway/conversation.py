"""Digests of a chat conversation, for token-in mode's parent lookup (a leaf: no gateway imports).

A token-in span records `history_digest`: the digest of its request's messages followed by the
answer it returned. The next call of the conversation sends those messages back, the answer among
them, so the digest of its first k messages equals the parent's for some k; any replica finds that
parent among the episode's spans. Digests are chained (`digest(m[:i+1]) = h(digest(m[:i]), m[i])`),
so one pass gives the digest of every prefix.

What a digest covers is what a client keeps when it echoes a turn back: role, text, tool calls by
name and decoded arguments, a tool result's text. Ids and reasoning are left out: clients rewrite
the first and often drop the second, and the token ids of the parent carry both anyway.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from harnessrl.shared.contracts import TokenInCase

_EMPTY = ""


def prefix_digests(messages: Sequence[Any]) -> list[str]:
    """`result[i]`: the digest of `messages[: i + 1]`."""
    digests, current = [], _EMPTY
    for message in messages:
        current = extend(current, message)
        digests.append(current)
    return digests


def extend(digest: str, message: Any) -> str:
    """The digest of a conversation whose digest is `digest`, followed by `message`."""
    return hashlib.sha256((digest + "\x1e" + _canonical(message)).encode()).hexdigest()[:32]


def _canonical(message: Any) -> str:
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, default=str)
    calls = message.get("tool_calls")
    return json.dumps(
        {
            "role": message.get("role"),
            "content": text_of(message.get("content")),
            "tool_calls": [_call(c) for c in calls if isinstance(c, dict)] if isinstance(calls, list) else [],
            "name": message.get("name") or "",
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list joined (None: empty)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return ""


def _call(call: dict[str, Any]) -> list[Any]:
    nested = call.get("function")
    function: dict[str, Any] = nested if isinstance(nested, dict) else call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's depth
            return [function.get("name"), arguments]
    return [function.get("name"), json.dumps(arguments, sort_keys=True, ensure_ascii=False)]


class TokenInCall:
    """A token-in call's case and conversation: what its span records."""

    __slots__ = ("answer", "case", "parent", "request_digest")

    def __init__(self, case: TokenInCase, request_digest: str, parent: str | None = None) -> None:
        self.case: TokenInCase = case
        self.request_digest = request_digest  # of the request's messages
        self.parent = parent  # the span whose sampled ids the prompt starts with (`extended`)
        self.answer: dict[str, Any] | None = None  # the first choice's message, once answered

    def history_digest(self) -> str:
        """Digest of the request's messages followed by the answer ("" before an answer)."""
        return extend(self.request_digest, self.answer) if self.answer is not None else ""
