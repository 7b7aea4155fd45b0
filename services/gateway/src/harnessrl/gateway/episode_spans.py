"""One episode's spans as this gateway replica knows them: a cache of the episode's SPANS subject.

Any replica may serve any call of an episode, concurrently with the others, so this is never the
truth; the subject is. A span is appended on a condition: that the subject's last message is still
the one this cache knows (`expected`, JetStream's `Nats-Expected-Last-Subject-Sequence`). So `seq`,
the number of spans stored before it, can neither repeat nor skip, and a stale cache costs a retry:
the recorder `learn`s the spans that beat it (or `rebuild`s from the whole subject when that is not
enough) and numbers and encodes the span again.

Deltas: the cache keeps the contexts (prompt + first completion) of the newest few `ok` spans it
knows are stored, and encodes a new prompt against the one it shares the longest prefix with, so a
parent is always a stored span, and a call extends its predecessor whichever replica served that.
A context that a newer one extends is kept as a prefix of the newer one's list, not as a copy of
its own: a conversation costs one list, not one per kept span.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from harnessrl.shared import subjects
from harnessrl.shared.bus.base import Delivery, LastOnSubject
from harnessrl.shared.contracts import ContractError, Span
from harnessrl.shared.log import get_logger
from harnessrl.shared.tokens import (
    TokenDeltaError,
    common_prefix_len,
    decode_prompt,
    reconstruct_prompts,
    span_context,
)

log = get_logger(__name__)

# Candidate parents kept per episode. Sequential calls need one (the last span); more let a replica
# decode what parallel calls on other replicas stored (their parents are recent too) without a
# rebuild, and encode a call of one branch of a fan-out against its own branch.
KEPT_CONTEXTS = 4


class EpisodeSpans:
    """Next seq, the subject's last stream sequence and recent contexts of one episode.

    `lock` serialises this replica's appends to the episode: its own calls never race each other,
    only other replicas' calls.
    """

    __slots__ = ("_contexts", "_digests", "last_stream_seq", "lock", "next_seq")

    def __init__(self) -> None:
        self.next_seq = 0
        self.last_stream_seq = 0  # 0: no span stored (as far as this replica knows)
        self.lock = asyncio.Lock()
        # span id -> (ids, length): the span's context is ids[:length]. Oldest first.
        self._contexts: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        # Token-in mode: span id -> `Span.history_digest`, for the kept contexts that have one.
        self._digests: dict[str, str] = {}

    @property
    def expected(self) -> LastOnSubject:
        """The condition of the next append: the subject's last message is the last one known here."""
        return LastOnSubject(stream=subjects.SPANS.name, seq=self.last_stream_seq)

    def next_span(self, draft: Span, prompt: list[int] | None) -> Span:
        """`draft` numbered as the episode's next span, its prompt encoded against a known context."""
        parent, prefix_len, suffix = self._delta(prompt)
        return msgspec.structs.replace(
            draft, seq=self.next_seq, parent_span=parent, prefix_len=prefix_len, prompt_suffix_ids=suffix
        )

    def _delta(self, prompt: list[int] | None) -> tuple[str | None, int, list[int]]:
        """`(parent, prefix_len, suffix)`: the context sharing the longest prefix (newest on ties)."""
        if not prompt:
            return None, 0, []
        parent, best = None, 0
        tried: set[int] = set()
        for span_id, (ids, length) in reversed(self._contexts.items()):
            if id(ids) in tried:
                continue  # a newer span's context is this whole list, and extends this one
            tried.add(id(ids))
            shared = common_prefix_len(ids if length == len(ids) else ids[:length], prompt)
            if shared > best:
                parent, best = span_id, shared
        return parent, best, prompt[best:]

    def appended(self, span: Span, stream_seq: int, prompt: list[int] | None) -> None:
        """`span` (with its decoded prompt, if needed) is stored at `stream_seq`, the subject's last."""
        self.next_seq = max(self.next_seq, span.seq + 1)
        self.last_stream_seq = stream_seq
        if span.status == "ok" and prompt is not None:
            self._remember(span, span_context(prompt, span))

    def _remember(self, span: Span, context: list[int]) -> None:
        parent = self._contexts.get(span.parent_span) if span.parent_span else None
        if parent is not None and span.prefix_len == parent[1]:
            # `context` starts with the parent's whole context: what lives on its list moves over.
            shared = parent[0]
            for span_id, (ids, length) in list(self._contexts.items()):
                if ids is shared and length <= span.prefix_len:
                    self._contexts[span_id] = (context, length)
        self._contexts[span.span_id] = (context, len(context))
        if span.history_digest:
            self._digests[span.span_id] = span.history_digest
        while len(self._contexts) > KEPT_CONTEXTS:
            forgotten, _ = self._contexts.popitem(last=False)
            self._digests.pop(forgotten, None)

    def conversation_parent(self, digests: Sequence[str]) -> tuple[str, list[int], int] | None:
        """Token-in: the kept span whose conversation is the longest prefix of a request's.

        `digests[i]` is the digest of the request's first i + 1 messages. Returns the span, its
        context (prompt + first completion) and how many of the request's messages it covers.
        """
        by_digest = {digest: span_id for span_id, digest in self._digests.items()}
        for turns in range(len(digests), 0, -1):
            span_id = by_digest.get(digests[turns - 1])
            context = self._context(span_id) if span_id is not None else None
            if span_id is not None and context is not None:
                return span_id, context, turns
        return None

    def learn(self, deliveries: Sequence[Delivery]) -> bool:
        """Apply the spans stored after the last known one, oldest first.

        False when one can't be read or decoded from the contexts kept here (its parent was
        forgotten): then only `rebuild` brings the cache up to date.
        """
        for delivery in deliveries:
            try:
                span = delivery.decode(Span)
                prompt = self._decode(span)
            except (ContractError, TokenDeltaError):
                return False
            self.appended(span, delivery.stream_seq, prompt)
        return True

    def _decode(self, span: Span) -> list[int] | None:
        if span.status != "ok":
            return None  # never a parent: its prompt is not needed here
        context = None
        if span.parent_span is not None:
            context = self._context(span.parent_span)
        return decode_prompt(span, context)

    def _context(self, span_id: str) -> list[int] | None:
        found = self._contexts.get(span_id)
        if found is None:
            return None
        ids, length = found
        return ids if length == len(ids) else ids[:length]

    def rebuild(self, deliveries: Sequence[Delivery]) -> None:
        """Start over from every message on the subject (a `replay`, in stream order)."""
        spans = _readable(deliveries)
        self.next_seq = max((span.seq for span in spans), default=-1) + 1
        self.last_stream_seq = deliveries[-1].stream_seq if deliveries else 0
        self._contexts.clear()
        self._digests.clear()
        try:
            prompts = reconstruct_prompts(spans)
        except TokenDeltaError as exc:  # no parent then: the next prompts are stored whole
            log.warning("episode.delta_chain_broken", error=str(exc))
            return
        ok = sorted((span for span in spans if span.status == "ok"), key=lambda span: span.seq)
        for span in ok[-KEPT_CONTEXTS:]:
            self._remember(span, span_context(prompts[span.span_id], span))


def _readable(deliveries: Sequence[Delivery]) -> list[Span]:
    spans = []
    for delivery in deliveries:
        try:
            spans.append(delivery.decode(Span))
        except ContractError:
            log.warning("episode.span_unreadable", subject=delivery.subject, stream_seq=delivery.stream_seq)
    return spans
