"""Token-in answer parsing against vLLM's own parser classes (no server: CPU-fast).

Each parser's table of sampled texts is parsed by the gateway (`tool_parse`, `reasoning_parse`)
and by vLLM's chat-route parser (`ParserManager.get_parser(...).parse`, what the chat route calls
with `--tool-call-parser` / `--reasoning-parser`), built on the tiny model's tokenizer (plus the
format's marker token where the tiny model lacks it). Reasoning, content, call names and decoded
arguments must be equal. Streams fed in random chunkings must end with what the whole parse gives.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from harnessrl.gateway.reasoning_parse import REASONING_PARSERS, reasoning_parser
from harnessrl.gateway.settings import GatewaySettings, read_settings
from harnessrl.gateway.tool_parse import TOOL_PARSERS, tool_parser
from harnessrl.gateway.tool_parse.answer import Answer, AnswerParser
from harnessrl.shared.settings import SettingsError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "s": {"type": "string"},
                    "o": {"type": "object"},
                    "n": {"type": ["number", "null"]},
                    "b": {"type": "boolean"},
                    "e": {"enum": [1, 2]},
                    "u": {"anyOf": [{"type": "array"}, {"type": "string"}]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}},
]
# Marker tokens vLLM's parsers look up in the vocabulary (the tiny Qwen3 model has hermes' own).
MARKERS = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}

H = '<tool_call>\n{"name": "get", "arguments": {"a": 1, "s": "x"}}\n</tool_call>'
H2 = '<tool_call>{"name": "put", "arguments": {}}</tool_call>'
Q = "<tool_call>\n<function=get>\n<parameter=a>\n5\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>"  # noqa: E501
Q2 = "<tool_call>\n<function=put>\n<parameter=z>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
L = '{"name": "get", "parameters": {"a": 1}}'
M = '[TOOL_CALLS][{"name": "get", "arguments": {"a": 1}}, {"name": "put"}]'

TEXTS: dict[str, list[str]] = {
    "hermes": [
        "plain text",
        "",
        H,
        "before " + H,
        H + H2,
        H + "\n" + H2,
        "  \n" + H,
        H + " after",
        "<tool_call>{not json}</tool_call>",
        H + "<tool_call>{bad",
        '<tool_call>{"name": "get", "arguments": {}}',
        '<tool_call>{"name": "get"}</tool_call>',
        "<tool_call>[1]</tool_call>",
        "a <tool_call",
        "x </tool_call>",
    ],
    "llama3_json": [
        "plain text",
        L,
        "<|python_tag|>" + L,
        L + "; " + L.replace("get", "put"),
        "see " + L + " and",
        '{"name": "get", "arguments": {"a": {"b": 1}}}',
        '{"x": 1}',
        '{"name": "get"}',
        '{"name": 5, "arguments": {}}',
        '{"name": "get", "arguments":',
        "a { b",
        L + ' {"oops"',
        "[" + L + "]",
        L + L,
        "<|python_tag|> no json",
    ],
    "mistral": [
        "plain text",
        M,
        "ahead " + M,
        "  " + M,
        M + " trailing",
        '[TOOL_CALLS] [{"name": "get", "arguments": {"a": [1]}}]',
        '[TOOL_CALLS][{"name": "get"',
        '[TOOL_CALLS]junk [{"name": "put", "arguments": {"k": 1}}] more',
        "[TOOL_CALLS]",
        "[TOOL_CALLS][]",
        "a [TOOL_CALLS",
        '[TOOL_CALLS][{"name": "get", "arguments": "{\\"a\\": 1}"}]',
    ],
    "qwen3_coder": [
        "plain text",
        "",
        Q,
        "pre" + Q,
        Q + "post",
        Q + "\n" + Q2,
        "pre" + Q + "mid" + Q2 + "post",
        "  \n" + Q,
        "<tool_call>\n</tool_call>rest",
        "<tool_call>\n</tool_call>rest" + Q,
        "pre<tool_call>",
        "<tool_call>",
        "pre<tool_call>\n<function=get",
        "pre<tool_call>\n<function=get>",
        "pre" + Q[:40],
        "<function=get><parameter=s>1</parameter></function>",
        Q.replace("get", "nope"),
        Q.replace("5", "x1"),
        Q.replace("a>\n5", "n>\nnull"),
        Q.replace("a>\n5", "n>\n2.5"),
        Q.replace("a>\n5", 'o>\n{"k": 1}'),
        Q.replace("a>\n5", "b>\nTrue"),
        Q.replace("a>\n5", "e>\n2"),
        Q.replace("a>\n5", "u>\n[1]"),
        Q.replace("a>\n5", "u>\nword"),
        Q.replace("a>\n5", "zz>\n5"),
        Q.replace("</parameter>\n<parameter=s>", "\n<parameter=s>"),
        Q.replace("</tool_call>", ""),
        Q.replace("\n</parameter>\n</function>\n</tool_call>", ""),
        "<tool_call>\n<function=get>\n</function>\n</tool_call>",
        "x</think>y",
        Q + Q.replace("<tool_call>\n", ""),
        "a > b <function c",
        "  ",
        "  <tool_call>",
        " a <tool_call>\n</tool_call> b ",
        "\n\n<tool_call>x</tool_call>",
        "pre \n\n" + Q,
        "pre \n" + Q + " \n",
    ],
}
# Reasoning first (the chat route splits it off before parsing tools).
REASONING_TEXTS = [
    "plain",
    "",
    "<think>r</think>c",
    "r</think>c",
    "<think>r",
    "<think></think>x",
    "r</think>",
    "a</think>b</think>c",
    "x<think>r</think>c",
    "a</think>b<think>c",
    "<think>r</think>\n\n" + H,
    "<think>r" + H,
    "r</think>" + Q,
    "<think>r" + Q,
    "<think>\nstep\n</think>\n\nanswer",
]
# vLLM raises on these (the chat call fails); the gateway answers the text as content instead.
VLLM_RAISES = {
    "mistral": [
        '[TOOL_CALLS]{"name": "get", "arguments": {}}',
        "x[TOOL_CALLS][1][TOOL_CALLS][2]",
        '[TOOL_CALLS][{"arguments": {}}]',
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model: Path) -> dict[str, Any]:
    """The tiny model's tokenizer per tool parser (with the marker token the format needs)."""
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(tiny_model)
    out = {name: base for name in TOOL_PARSERS}
    for name, marker in MARKERS.items():
        out[name] = copy.deepcopy(base)
        out[name].add_special_tokens({"additional_special_tokens": [marker]})
    logging.getLogger("vllm").setLevel(logging.CRITICAL)  # they log every unparseable call
    return out


def vllm_answer(
    tokenizer: Any, tool: str | None, reasoning: str | None, text: str, kwargs: Any = None
) -> Answer:
    """What vLLM's chat route makes of `text` with these parsers."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS, chat_template_kwargs=kwargs
    )
    parser_cls = ParserManager.get_parser(tool, reasoning, enable_auto_tools=True)
    assert parser_cls is not None
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs or {})
    found, content, calls = parser.parse(text, request, enable_auto_tools=True)
    entries = [
        {"function": {"name": call.name, "arguments": call.arguments}, "id": call.id} for call in calls or []
    ]
    return Answer(found, content, entries)


def gateway_answer(tool: str | None, reasoning: str | None, text: str, kwargs: Any = None) -> Answer:
    body = {"tools": TOOLS, "chat_template_kwargs": kwargs}
    return AnswerParser(
        tool_parser(tool, TOOLS) if tool else None, reasoning_parser(reasoning, body) if reasoning else None
    ).parse(text)


def comparable(answer: Answer) -> tuple[Any, ...]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls]
    return answer.reasoning, answer.content, calls


def streamed(parser: AnswerParser, text: str, seed: int) -> Answer:
    """`text` fed in random pieces (empty ones too), the last flagged done."""
    rng, at, stream = random.Random(seed), 0, parser.stream()
    while True:
        step = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
        piece, at = text[at : at + step], at + step
        done = at >= len(text)
        calls = stream.feed(piece, done=done)[2]
        assert all("index" in call for call in calls)
        if done:
            return stream.answer()


@pytest.mark.parametrize(("tool", "text"), [(name, text) for name, texts in TEXTS.items() for text in texts])
def test_tool_calls_as_vllm_parses_them(tokenizers: dict[str, Any], tool: str, text: str) -> None:
    assert comparable(gateway_answer(tool, None, text)) == comparable(
        vllm_answer(tokenizers[tool], tool, None, text)
    )


@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("tool", [None, "hermes", "qwen3_coder"])
@pytest.mark.parametrize("text", REASONING_TEXTS)
def test_reasoning_split_as_vllm_does(
    tokenizers: dict[str, Any], reasoning: str, tool: str | None, text: str
) -> None:
    tokenizer = tokenizers[tool or "hermes"]
    assert comparable(gateway_answer(tool, reasoning, text)) == comparable(
        vllm_answer(tokenizer, tool, reasoning, text)
    )


@pytest.mark.parametrize("text", REASONING_TEXTS[:8])
def test_qwen3_thinking_off_is_all_content(tokenizers: dict[str, Any], text: str) -> None:
    off = {"enable_thinking": False}
    expected = vllm_answer(tokenizers["qwen3_coder"], "qwen3_coder", "qwen3", text, off)
    assert comparable(gateway_answer("qwen3_coder", "qwen3", text, off)) == comparable(expected)


@pytest.mark.parametrize(
    ("tool", "text"), [(name, text) for name, texts in VLLM_RAISES.items() for text in texts]
)
def test_what_vllm_fails_on_is_content(tokenizers: dict[str, Any], tool: str, text: str) -> None:
    with pytest.raises((ValueError, TypeError, KeyError)):
        vllm_answer(tokenizers[tool], tool, None, text)
    assert gateway_answer(tool, None, text) == Answer(None, text, [])


def test_mistral_ids_are_what_its_templates_accept(tokenizers: dict[str, Any]) -> None:
    ours = gateway_answer("mistral", None, M).tool_calls
    theirs = vllm_answer(tokenizers["mistral"], "mistral", None, M).tool_calls
    assert [len(c["id"]) for c in ours] == [len(c["id"]) for c in theirs] == [9, 9]
    assert all(c["id"].isalnum() for c in ours)


# Where a stream can't take back content it released before the whole parse drops it.
STREAM_DIFFERS = {
    ("llama3_json", "see " + L + " and"): "see ",
    ("llama3_json", "[" + L + "]"): "[",
    ("mistral", '[TOOL_CALLS]junk [{"name": "put", "arguments": {"k": 1}}] more'): None,
    ("hermes", H + "<tool_call>{bad"): "released",
}


@pytest.mark.parametrize(("tool", "text"), [(name, text) for name, texts in TEXTS.items() for text in texts])
@pytest.mark.parametrize("seed", range(4))
def test_streams_end_as_the_whole_parse(tool: str, text: str, seed: int) -> None:
    parser = AnswerParser(tool_parser(tool, TOOLS), None)
    whole, stream = parser.parse(text), streamed(parser, text, seed)
    differs = STREAM_DIFFERS.get((tool, text))
    if differs == "released":  # an earlier call went out before a later one proved unreadable
        assert (whole.tool_calls, len(stream.tool_calls)) == ([], 1)
        return
    assert comparable(stream)[2] == comparable(whole)[2]
    expected = whole.content if differs is None or differs == "" else differs
    assert stream.content == (expected or None)


# deepseek_r1's whole split drops text before a `<think>` anywhere; a stream released it already.
REASONING_STREAM_DIFFERS = {
    ("deepseek_r1", "a</think>b<think>c"): ("a", "b<think>c"),
    ("deepseek_r1", "x<think>r</think>c"): ("xr", "c"),
}


@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", REASONING_TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_reasoning_streams_end_as_the_whole_split(reasoning: str, text: str, seed: int) -> None:
    parser = AnswerParser(tool_parser("hermes", TOOLS), reasoning_parser(reasoning))
    whole, stream = parser.parse(text), streamed(parser, text, seed)
    differs = REASONING_STREAM_DIFFERS.get((reasoning, text))
    expected = comparable(whole) if differs is None else (*differs, [])
    # A stream can't tell empty reasoning (`<think></think>`) from none.
    assert comparable(stream) == (expected[0] or None, *expected[1:])


def test_include_reasoning_false_drops_it() -> None:
    body = {"include_reasoning": False}
    parser = AnswerParser.for_request(body, "hermes", "qwen3")
    assert parser.parse("<think>r</think>c") == Answer(None, "c", [])
    assert streamed(parser, "<think>r</think>c", 0) == Answer(None, "c", [])


def test_tools_are_parsed_only_when_the_chat_route_would() -> None:
    text = '<tool_call>{"name": "put", "arguments": {}}</tool_call>'
    assert (
        AnswerParser.for_request({"tools": TOOLS, "tool_choice": "none"}, "hermes", "").parse(text).content
        == text
    )
    assert AnswerParser.for_request({}, "hermes", "").parse(text).content == text
    assert len(AnswerParser.for_request({"tools": TOOLS}, "hermes", "").parse(text).tool_calls) == 1


def test_unknown_names_fail_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, qwen3_coder"):
        tool_parser("pythonic")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("granite")
    with pytest.raises(SettingsError, match="tool_parser must be one of"):
        GatewaySettings(tool_parser="nope")
    with pytest.raises(SettingsError, match="reasoning_parser must be empty or one of"):
        GatewaySettings(reasoning_parser="nope")
    assert GatewaySettings(tool_parser="qwen3_coder", reasoning_parser="qwen3").reasoning_parser == "qwen3"


def test_parsers_are_set_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HRL_GATEWAY_TOOL_PARSER", "qwen3_coder")
    monkeypatch.setenv("HRL_GATEWAY_REASONING_PARSER", "deepseek_r1")
    settings = read_settings(key_secret="k")
    assert (settings.tool_parser, settings.reasoning_parser) == ("qwen3_coder", "deepseek_r1")
    monkeypatch.setenv("HRL_GATEWAY_TOOL_PARSER", "hermes2")
    with pytest.raises(SettingsError, match="tool_parser must be one of"):
        read_settings(key_secret="k")


SAMPLED = "<think>r</think>c" + Q


def token_in_api(parser: AnswerParser) -> Any:
    from harnessrl.gateway.conversation import TokenInCall
    from harnessrl.gateway.token_in import _WRAPPERS

    return _WRAPPERS["chat"](None, TokenInCall("fresh", ""), parser=parser, top_logprobs=0)  # type: ignore[arg-type]


def test_token_in_answers_reasoning_and_calls_as_the_chat_route() -> None:
    parser = AnswerParser.for_request({"tools": TOOLS}, "qwen3_coder", "qwen3")
    api = token_in_api(parser)
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": SAMPLED, "finish_reason": "stop"}]}
    choice = api._answer(body)["choices"][0]
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == ("r", "c")
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "a": 5,
        "s": "hi there",
    }
    assert choice["finish_reason"] == "tool_calls"
    assert api.call.answer == choice["message"]


def test_token_in_streams_reasoning_deltas() -> None:
    api = token_in_api(AnswerParser.for_request({"tools": TOOLS}, "qwen3_coder", "qwen3"))
    pieces = [SAMPLED[at : at + 4] for at in range(0, len(SAMPLED), 4)]
    deltas = []
    for at, piece in enumerate(pieces):
        finish = "stop" if at == len(pieces) - 1 else None
        chunk = api._chunk(
            {"id": "cmpl-1", "choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
        )
        deltas.append(chunk["choices"][0])
    reasoning = "".join(d["delta"].get("reasoning", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert (reasoning, content, [c["function"]["name"] for c in calls]) == ("r", "c", ["get"])
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert api.call.answer["reasoning"] == "r"
