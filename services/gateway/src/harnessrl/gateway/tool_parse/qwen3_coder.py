"""`qwen3_coder`: `<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>`.

As vLLM's engine grammar (`vllm/parser/qwen3.py`, content state, no reasoning in it): a call
starts at `<tool_call>` or a bare `<function=`; the name runs to `>`; parameters are
`<parameter=P>` up to `</parameter>` (or the next `<parameter=`), one wrapping newline trimmed; a
call ends at `</function>` or the end of the text (an open call with a name is still a call).
Values are strings, typed by the tool's JSON schema when the request gives one
(`coerce_to_schema_type` in `vllm/tool_parsers/utils.py`). With calls, the content is the text
before the first one, stripped; without, all text outside tool-call markup (None when that is only
whitespace around markup).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar

from harnessrl.gateway.tool_parse.base import Call, Parsed, ToolCallParser, tool_call

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END, CLOSE = "<function=", "</function>", ">"
_PARAMETER = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL
)
# Per grammar state, the tags it reacts to; any other text is the state's own.
_TAGS: dict[str, tuple[str, ...]] = {
    "content": (TOOL_START, FUNCTION),
    "preamble": (TOOL_END, FUNCTION),
    "name": (CLOSE, FUNCTION_END),
    "args": (FUNCTION_END,),
    "between": (TOOL_END, TOOL_START, FUNCTION),
}
_NEXT = {
    ("content", TOOL_START): "preamble", ("content", FUNCTION): "name",
    ("preamble", TOOL_END): "content", ("preamble", FUNCTION): "name",
    ("name", CLOSE): "args", ("name", FUNCTION_END): "between", ("args", FUNCTION_END): "between",
    ("between", TOOL_END): "content", ("between", TOOL_START): "preamble", ("between", FUNCTION): "name",
}  # fmt: skip


class Qwen3Coder(ToolCallParser):
    """XML-ish calls whose parameter values are typed by the tool's schema."""

    name = "qwen3_coder"
    call_starts: ClassVar[tuple[str, ...]] = (TOOL_START, FUNCTION)
    call_end = FUNCTION_END
    engine_based = True
    strips_content = True

    def extract(self, text: str) -> Parsed:
        """Content and calls of the whole text."""
        before, outside, slots = _scan(text)
        calls = [self._call(name.strip(), raw) for name, raw in slots if name.strip()]
        if calls:
            return (before or "").strip() or None, calls
        if before is not None and not outside.strip():  # only whitespace around tool-call markup
            return None, []
        return outside or None, []

    def _call(self, name: str, raw: str) -> Call:
        values: dict[str, Any] = {}
        for match in _PARAMETER.finditer(raw):
            values[match.group(1)] = _trim_newlines(match.group(2))
        properties = _properties(self.tools, name)
        for key, value in values.items():
            if isinstance(properties.get(key), dict):
                values[key] = coerce(value, schema_types(properties[key]))
        return tool_call(name, values)


def _scan(text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
    """`(content before the first call start or None, all content, [(name, raw arguments)])`."""
    state, at, before, outside = "content", 0, None, []
    slots: list[list[str]] = []
    while True:
        tag, found = _next_tag(text, at, _TAGS[state])
        piece = text[at:found]
        if state == "content":
            outside.append(piece)
        elif state in ("name", "args"):
            slots[-1][0 if state == "name" else 1] += piece
        if tag is None:
            break
        if state == "content" and before is None:
            before = "".join(outside)
        if tag in (TOOL_START, FUNCTION) and state in ("content", "between"):
            slots.append(["", ""])
        state, at = _NEXT[state, tag], found + len(tag)
    return before, "".join(outside), [(name, raw) for name, raw in slots]


def _next_tag(text: str, at: int, tags: tuple[str, ...]) -> tuple[str | None, int]:
    """The earliest of `tags` in `text` from `at`, and where; `(None, len(text))` when none."""
    found = [(pos, tag) for tag in tags if (pos := text.find(tag, at)) >= 0]
    if not found:
        return None, len(text)
    pos, tag = min(found)
    return tag, pos


def _trim_newlines(value: str) -> str:
    """One leading and one trailing newline off (the template's markup)."""
    return value.removeprefix("\n").removesuffix("\n")


def _properties(tools: list[Any], name: str) -> dict[str, Any]:
    """The JSON-schema `properties` of the request's function tool `name` ({} when none)."""
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64"), "integer"),
    **dict.fromkeys(("long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean", "dict": "object", **dict.fromkeys(("arr", "list", "sequence"), "array"),
}  # fmt: skip
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def schema_types(schema: Any) -> set[str]:
    """Every type a JSON schema allows: `type`, the enum's values, `anyOf`/`oneOf`/`allOf`."""
    if not isinstance(schema, dict):
        return {"string"}
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or [] if isinstance(t, str)}
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add(
            "null" if value is None else next((n for k, n in _ENUM_TYPES if isinstance(value, k)), "string")
        )
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            types |= schema_types(choice)
    return types or {"string"}


def coerce(value: str, types: set[str]) -> Any:
    """`value` as the first of `types` it reads as; when none, as finite JSON, else the string.

    Types are tried null, integer, number, boolean, object, array, string (vLLM's order).
    """
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _PRIORITY:
        if kind not in wanted:
            continue
        if kind == "string":
            return value
        converted = _as(kind, value)
        if converted is not _NO:
            return converted
    parsed = _json(value)
    return value if parsed is _NO else parsed


_NO: Any = object()


def _as(kind: str, value: str) -> Any:
    """`value` read as `kind`, or `_NO`."""
    if kind == "null":
        return None if value.lower() == "null" else _NO
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(value.lower().strip(), _NO)
    if kind in ("integer", "number"):
        return _number(value, integer=kind == "integer")
    return _json(value)  # object, array


def _number(value: str, *, integer: bool) -> Any:
    """`value` as an int (`integer`) or a finite number (integral ones as int), or `_NO`."""
    try:
        number: float = int(value) if integer else float(value)
    except ValueError:
        return _NO
    if integer:
        return number
    return _NO if not math.isfinite(number) else (int(number) if number == int(number) else number)


def _json(value: str) -> Any:
    """`value` as finite JSON, or `_NO`."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return _NO
    return parsed if _finite(parsed) else _NO


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True
