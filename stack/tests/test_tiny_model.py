from pathlib import Path

from transformers import AutoConfig, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from harnessrl.stack.demo.tiny_corpus import synthetic_corpus
from harnessrl.stack.demo.tiny_model import build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def _tool_call(arguments: object) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}


def test_build_is_deterministic(tmp_path: Path) -> None:
    corpus = synthetic_corpus(seed=3, size=400)
    first = build_tiny_model(tmp_path / "a", corpus, seed=3)
    second = build_tiny_model(tmp_path / "b", corpus, seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_config_is_servable_shape(tiny_model: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert config.model_type == "qwen3"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (128, 2, 32)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tokenizer_splits_digits_and_keeps_markers(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("CALC 12*34<tool_call></think>"))
    assert tokens[tokens.index("1") : tokens.index("1") + 5] == ["1", "2", "*", "3", "4"]
    assert tokens[-2:] == ["<tool_call>", "</think>"]
    text = "ANSWER 408 ls -la | grep x"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_hermes_tool_calls(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def render(arguments: object) -> str:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12*34?"},
            {"role": "assistant", "content": None, "tool_calls": [_tool_call(arguments)]},
            {"role": "tool", "tool_call_id": "c1", "content": "RESULT 408"},
        ]
        out = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert isinstance(out, str)
        return out

    text = render('{"command": "echo 408"}')
    assert text == render({"command": "echo 408"})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "bash"' in text.split("\n</tools>")[0].split("<tools>\n")[1]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo 408"}}'
        "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nRESULT 408\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_vllm_hermes_parser_reads_a_rendered_tool_call(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    call = _tool_call('{"command": "ls -la"}')
    messages = [
        {"role": "user", "content": "Look around."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    turn = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    request = ChatCompletionRequest(model="tiny", messages=messages[:1], tools=TOOLS)
    parsed = Hermes2ProToolParser(tokenizer, TOOLS).extract_tool_calls(turn, request)
    assert parsed.tools_called
    assert parsed.content == "Let me look.\n"
    [tool_call] = parsed.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("bash", call["function"]["arguments"])
