"""`mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` calls.

As the JSON-array path of `vllm/parser/mistral.py` (vocabularies without `[ARGS]`, i.e. not the
v11+ `[TOOL_CALLS]name[ARGS]{...}` format): content is the text before the marker (None when only
whitespace); the first JSON value after it is the list, else the outermost `[{...}]` in it; when
neither reads, the text after the marker (stripped) is the content (empty: None). Ids are 9
letters or digits, which Mistral chat templates require.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, ClassVar

from harnessrl.gateway.tool_parse.base import Parsed, ToolCallParser, tool_call

TOOL_CALLS = "[TOOL_CALLS]"
_LIST = re.compile(r"\[\{.*\}\]", re.DOTALL)
_ID_ALPHABET = string.ascii_letters + string.digits
_decoder = json.JSONDecoder()


class Mistral(ToolCallParser):
    """A JSON list of calls after `[TOOL_CALLS]`."""

    name = "mistral"
    call_starts: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    engine_based = True

    def extract(self, text: str) -> Parsed:
        """The calls after the marker.

        vLLM raises (the call fails) on a second marker or on calls without a name; here the text
        is then content.
        """
        before, marker, after = text.partition(TOOL_CALLS)
        if not marker or TOOL_CALLS in after:
            return text or None, []
        listed = _listed(after.strip())
        if listed is None:
            return after.strip() or None, []
        if not isinstance(listed, list) or not all(_is_call(item) for item in listed):
            return text, []
        calls = [tool_call(item["name"], item.get("arguments", {}), mistral_id()) for item in listed]
        return (before if before.strip() else None), calls


def _listed(raw: str) -> Any:
    """The first JSON value of `raw`, else its outermost `[{...}]`; None when neither reads."""
    try:
        return _decoder.raw_decode(raw)[0]
    except ValueError:
        found = _LIST.search(raw)
    try:
        return json.loads(found.group(0)) if found else None
    except ValueError:
        return None


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def mistral_id() -> str:
    """A tool call id as Mistral's templates accept it: 9 letters or digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
