"""A tiny Qwen3 chat model generated on the spot, with no downloads.

Model hubs are unreachable from tests and the demo, so the model is built locally: a byte-level
BPE tokenizer trained on a synthetic corpus (digits split into single tokens, ChatML special tokens,
Qwen/hermes-style tool calls in the chat template) and a Qwen3 config with random weights (hidden
128, 2 layers, 4 heads of 32, 2 KV heads, tied embeddings: about 0.5M parameters). vLLM's CPU
attention needs head_dim >= 32. Weights are saved as float32 safetensors: vLLM CPU serves them with
`--dtype float32` and its logprobs then match a float32 transformers forward pass.

The output is a pure function of (corpus, seed, this module's source): `cached_tiny_model` keys a
machine-wide cache on that, so concurrent test sessions build it once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from harnessrl.shared import cache
from harnessrl.stack.demo import tiny_corpus

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# Tool-call and reasoning markers are ordinary added tokens (not "special"): they must survive
# detokenization with skip_special_tokens, where vLLM's hermes parser looks for them in the text.
MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
DEFAULT_VOCAB_SIZE = 512

# ChatML with Qwen2.5/hermes tool calling. Arguments may arrive as a JSON string (OpenAI clients,
# transformers) or already decoded (vLLM decodes them before rendering); both render identically.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _train_tokenizer(corpus: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE with ChatML specials and the tool/think marker tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tokenizer


def _save_tokenizer(raw: Tokenizer, out_dir: Path) -> int:
    """Save `raw` as a HF fast tokenizer with the chat template; returns its vocab size."""
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    tokenizer.save_pretrained(out_dir)
    return len(tokenizer)


def _save_model(out_dir: Path, vocab_size: int, seed: int) -> None:
    """Save a randomly initialised float32 Qwen3 model sized for vLLM CPU."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[END_OF_TEXT],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=[ids[IM_END], ids[END_OF_TEXT]], pad_token_id=ids[END_OF_TEXT]
    )
    generation.save_pretrained(out_dir)


def build_tiny_model(
    out_dir: Path,
    corpus: Sequence[str] | None = None,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Path:
    """Write a tiny Qwen3 chat model (tokenizer, config, float32 weights) into `out_dir`.

    `corpus` trains the tokenizer (default: `tiny_corpus.synthetic_corpus(seed)`); the same corpus,
    seed and vocab size always give the same files. Returns `out_dir`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = list(corpus) if corpus is not None else tiny_corpus.synthetic_corpus(seed)
    raw = _train_tokenizer(texts, vocab_size)
    _save_model(out_dir, _save_tokenizer(raw, out_dir), seed)
    return out_dir


def generator_digest(seed: int = 0) -> str:
    """Digest of what decides the default model: this module, the corpus module and the seed."""
    digest = hashlib.sha256(f"seed={seed}".encode())
    for module in (__file__, tiny_corpus.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:16]


def cached_tiny_model(cache_root: Path | None = None, *, seed: int = 0) -> Path:
    """Return the default tiny model, building it once per machine under `cache_root`.

    The directory name carries `generator_digest`, so editing the generator makes a new model.
    """
    target = (cache_root or cache.cache_root()) / "tiny-model" / generator_digest(seed)
    return cache.build_once(target, lambda staging: build_tiny_model(staging, seed=seed), done="config.json")
