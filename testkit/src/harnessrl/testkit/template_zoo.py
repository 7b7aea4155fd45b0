"""A template zoo: tiny generated models whose chat templates break prompt merging like real ones do.

The trainer merges a rollout's calls into one row when each prompt extends the previous prompt plus
the tokens sampled (`harnessrl.trainer.samples`). Real chat templates and harnesses break that in a
few recurring ways; each zoo template reproduces one of them in a real Jinja chat template that
vLLM 0.31 serves (tools rendered for vLLM's `hermes` parser: `<tool_call>{json}</tool_call>`):

- `plain`: ChatML that renders a past model turn exactly as it was sampled (stable).
- `drops_reasoning`: Qwen3-style, `<think>..</think>` is removed from past assistant turns (Qwen3
  does it for turns before the last user message; here for every past turn).
- `retools`: tool-call arguments re-rendered as compact JSON with sorted keys, not as sampled.
- `whitespace`: a past turn's content is trimmed and a blank line separates turns (Llama-3 style).
- `system_rewrite`: the system prompt changes on every call (a counter, as a date or a tool list
  that changes would).

All zoo models share one set of weights: the default tiny model (`stack.demo.tiny_model`), warm
started (`trainer.warmstart`) to answer every call the same way, a short thought and then a bash
command, as a tool call when tools are offered and as a markdown block otherwise, then taught that
reply after histories as every zoo template renders them (a model this small soon strays after a
history it hasn't seen). Peaked like that, what it samples is (nearly always) the canonical
tokenization of that text, so a break comes from the template or the harness, not from the model.

Harness behaviours are small scripted clients on the openai SDK (`HARNESSES`): a tool-mode agent
(mini-swe-agent with native tool calls), a text-mode agent (bash in a markdown block), one that
compacts its history, and one that retries a call.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from harnessrl.shared import cache

# --- what the model says ------------------------------------------------------------------------------

COMMAND = "ls -la"
THOUGHT = "<think>\nI will look at the files.\n</think>\n"
# A tool-call reply: the hermes parser returns THOUGHT as content and the call as `tool_calls`.
TOOL_REPLY = (
    THOUGHT + '<tool_call>\n{"name": "bash", "arguments": {"command": "' + COMMAND + '"}}\n</tool_call>'
)
# A text-mode reply (mini-swe-agent's text mode parses a fenced block like this one).
TEXT_REPLY = THOUGHT + "```bash\n" + COMMAND + "\n```\n"
TOOL_OUTPUT = "README.md\nsetup.py\nsrc"
TASK = "List the files of the repository, then submit."
SYSTEM = "You are a helpful assistant that can run bash commands."
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}

# --- chat templates -----------------------------------------------------------------------------------

_SYSTEM_BLOCK = """\
{%- set system = messages[0].content if messages[0].role == 'system' else '' %}
{%- if tools or system %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- @SYSTEM_EXTRA@ + '<|im_end|>\\n' }}
{%- endif %}
"""

_TURNS = """\
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' + @GAP@ }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{{- '<|im_start|>assistant\\n' + @CONTENT@ }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson@ARGUMENTS@ }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' + @GAP@ }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' + @GAP@ }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _chat_template(
    *, system_extra: str = "''", content: str = "content", arguments: str = "", gap: str = "''"
) -> str:
    """ChatML with hermes tools; each argument is a Jinja expression replacing one rendering rule."""
    text = _SYSTEM_BLOCK + _TURNS
    for slot, expression in (
        ("@SYSTEM_EXTRA@", system_extra),
        ("@CONTENT@", content),
        ("@ARGUMENTS@", arguments),
        ("@GAP@", gap),
    ):
        text = text.replace(slot, expression)
    return text


class ZooTemplate(msgspec.Struct, frozen=True, kw_only=True):
    """A zoo chat template and what it does to prompts.

    `breaks` is the trainer's break class (`samples.MISMATCH_KINDS`) a call that follows a model
    turn gets under this template in plain mode (None: it extends the row). `rewrites_history`:
    the template changes what came before the last model turn, which no token-in mode can undo.
    """

    name: str
    chat_template: str
    breaks: str | None
    rewrites_history: bool = False


TEMPLATES: Mapping[str, ZooTemplate] = {
    template.name: template
    for template in (
        ZooTemplate(name="plain", chat_template=_chat_template(), breaks=None),
        ZooTemplate(
            name="drops_reasoning",
            chat_template=_chat_template(content="content.split('</think>')[-1].lstrip('\\n')"),
            breaks="template_dropped",
        ),
        ZooTemplate(
            name="retools",
            chat_template=_chat_template(arguments="(separators=(',', ':'), sort_keys=True)"),
            breaks="retokenized",
        ),
        ZooTemplate(
            name="whitespace",
            chat_template=_chat_template(content="content | trim", gap="'\\n'"),
            breaks="retokenized",
        ),
        ZooTemplate(
            name="system_rewrite",
            chat_template=_chat_template(
                system_extra="'\\nMessages so far: ' + (messages | length | string)"
            ),
            # The divergence lies inside the first prompt, which the trainer calls a branch.
            breaks="branch",
            rewrites_history=True,
        ),
    )
}

# --- models -------------------------------------------------------------------------------------------

# Warm start: enough steps on the fixed replies that sampling them at temperature 1 almost never strays.
WARM_STEPS = 300
WARM_BATCH = 16
WARM_LR = 3e-3
# Then the replies after histories in every zoo template (`_tune`), gentler: they are learnt already.
TUNE_STEPS = 150
TUNE_BATCH = 8
TUNE_LR = 1e-3


def _tool_call(command: str = COMMAND) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}


def demonstrations() -> list[dict[str, Any]]:
    """Conversations of 1 to 4 model turns, in tool mode and text mode, with and without a system prompt."""
    demos: list[dict[str, Any]] = []
    for turns in range(1, 5):
        for system in (True, False):
            head = [{"role": "system", "content": SYSTEM}] if system else []
            tool: list[dict[str, Any]] = [*head, {"role": "user", "content": TASK}]
            text: list[dict[str, Any]] = [*head, {"role": "user", "content": TASK}]
            for turn in range(turns):
                output = "\n".join(TOOL_OUTPUT.splitlines()[: turn + 1])
                tool += [
                    {"role": "assistant", "content": THOUGHT, "tool_calls": [_tool_call()]},
                    {"role": "tool", "content": output},
                ]
                text += [
                    {"role": "assistant", "content": TEXT_REPLY},
                    {"role": "user", "content": f"<output>\n{output}\n</output>"},
                ]
            demos += [{"messages": tool[:-1], "tools": [BASH_TOOL]}, {"messages": text[:-1]}]
    return demos


def _digest(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def zoo_base_model(cache_root: Path | None = None) -> Path:
    """The weights every zoo model shares, built once per machine (tokenizer: the plain template).

    A warm start on the demonstrations in the plain template, then a short pass in each zoo
    template, so that a context any of them renders is one the model has seen: off its
    demonstrations a model this small soon stops answering the same way. Keyed on what decides the
    weights (the tiny model, the demonstrations, the templates, the settings): a warm start takes
    minutes on 2 busy cores.
    """
    from harnessrl.stack.demo.tiny_model import cached_tiny_model, generator_digest

    root = cache_root or cache.cache_root()
    tiny = cached_tiny_model(root)
    key = _digest(
        generator_digest(), msgspec.json.encode(demonstrations()).decode(),
        TEMPLATES["plain"].chat_template, f"{WARM_STEPS}/{WARM_BATCH}/{WARM_LR}",
    )  # fmt: skip
    plain = cache.build_once(
        root / "template-zoo" / f"base-{key}", lambda staging: _warm_start(tiny, staging), done="config.json"
    )
    tuned = _digest(
        plain.name, *(t.chat_template for t in TEMPLATES.values()), f"{TUNE_STEPS}/{TUNE_BATCH}/{TUNE_LR}"
    )
    return cache.build_once(
        root / "template-zoo" / f"tuned-{tuned}", lambda staging: _tune(plain, staging), done="config.json"
    )


def _train(model_dir: Path, out_dir: Path, steps: int, batch: int, lr: float) -> None:
    """`trainer.warmstart.train` on the demonstrations, on one thread (the machine is shared)."""
    import torch

    from harnessrl.trainer.warmstart import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(model_dir, demonstrations(), out_dir, steps, batch, lr)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)


def _warm_start(tiny: Path, out_dir: Path) -> None:
    plain = out_dir / "plain-tokenizer"
    _with_template(tiny, plain, TEMPLATES["plain"].chat_template)
    _train(plain, out_dir, WARM_STEPS, WARM_BATCH, WARM_LR)
    shutil.rmtree(plain)


def _tune(plain: Path, out_dir: Path) -> None:
    """Imitate each demonstration's last reply after its history as every zoo template renders it.

    The reply is the text the model is to sample, tokenized as such, whatever the template would
    make of it afterwards (`warmstart.render` trains on the rendered turn, which would teach the
    model each template's rewrite).
    """
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harnessrl.trainer.warmstart import batches

    tokenizer = AutoTokenizer.from_pretrained(plain)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for template in TEMPLATES.values():
        for demo in demonstrations():
            tools = demo.get("tools")
            history = tokenizer.apply_chat_template(
                demo["messages"][:-1], tools=tools, chat_template=template.chat_template,
                add_generation_prompt=True, return_dict=False,
            )  # fmt: skip
            reply = [*tokenizer.encode(TOOL_REPLY if tools else TEXT_REPLY, add_special_tokens=False), end]
            rows.append(([*history, *reply], [0] * len(history) + [1] * len(reply)))
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TUNE_LR, weight_decay=0.0)
    rng = random.Random(0)  # noqa: S311 - reproducible batches, not security
    try:
        for _ in range(TUNE_STEPS):
            ids, attention, mask = batches(rows, TUNE_BATCH, tokenizer.pad_token_id, rng)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir, safe_serialization=True)
    _with_template(plain, out_dir, TEMPLATES["plain"].chat_template, weights=False)


def _with_template(source: Path, target: Path, chat_template: str, *, weights: bool = True) -> None:
    """Copy a model's files from `source` into `target`, its tokenizer carrying `chat_template`.

    `weights` False leaves the weights and config out (`_tune` writes its own).
    """
    from transformers import AutoTokenizer

    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and (weights or item.name not in ("model.safetensors", "config.json")):
            shutil.copy(item, target / item.name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(target)


def zoo_model(template: str, cache_root: Path | None = None) -> Path:
    """The zoo model whose tokenizer carries `template` (a `TEMPLATES` name), built once per machine."""
    chat_template = TEMPLATES[template].chat_template
    base = zoo_base_model(cache_root)
    target = base.parent / f"{template}-{_digest(base.name, chat_template)}"
    return cache.build_once(
        target, lambda staging: _with_template(base, staging, chat_template), done="config.json"
    )


# --- harness behaviours -------------------------------------------------------------------------------


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """How a scripted harness calls: its model turns and the sampling it asks for."""

    model: str = "tiny"
    turns: int = 4
    max_tokens: int = 64
    temperature: float = 1.0


# (client, sampling) -> how many calls the episode made; `client` is an `openai.AsyncOpenAI`.
HarnessRun = Callable[[Any, Sampling], Awaitable[int]]


@dataclass(frozen=True)
class ZooHarness:
    """A scripted harness and what it does to history (`rewrites_history`: no token-in mode undoes it)."""

    name: str
    run: HarnessRun
    rewrites_history: bool = False


def _start() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


async def _call(client: Any, sampling: Sampling, messages: list[dict[str, Any]], tools: bool) -> Any:
    extra: dict[str, Any] = {"tools": [BASH_TOOL]} if tools else {}
    reply = await client.chat.completions.create(
        model=sampling.model, messages=messages, max_tokens=sampling.max_tokens,
        temperature=sampling.temperature, **extra,
    )  # fmt: skip
    return reply.choices[0].message


def tool_output(turn: int) -> str:
    """What the command printed at model turn `turn` (it grows, as in the demonstrations)."""
    return "\n".join(TOOL_OUTPUT.splitlines()[: turn % 3 + 1])


def _tool_turn(message: Any, step: int) -> list[dict[str, Any]]:
    """The model turn as the harness keeps it, then the tool results (or a nudge when it called none)."""
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for call in message.tool_calls or []
    ]
    reply: dict[str, Any] = {"role": "assistant", "content": message.content}
    if calls:
        reply["tool_calls"] = calls
        output = tool_output(step)
        return [reply, *({"role": "tool", "tool_call_id": c["id"], "content": output} for c in calls)]
    return [reply, {"role": "user", "content": "Call the bash tool."}]


def _text_turn(message: Any, step: int) -> list[dict[str, Any]]:
    output = tool_output(step) if "```bash" in (message.content or "") else "No command found."
    return [
        {"role": "assistant", "content": message.content or ""},
        {"role": "user", "content": f"<output>\n{output}\n</output>"},
    ]


async def tool_agent(client: Any, sampling: Sampling) -> int:
    """mini-swe-agent in tool mode: native tool calls, results as `tool` messages."""
    messages = _start()
    for turn in range(sampling.turns):
        messages += _tool_turn(await _call(client, sampling, messages, tools=True), turn)
    return sampling.turns


async def text_agent(client: Any, sampling: Sampling) -> int:
    """mini-swe-agent in text mode: a bash block in the reply, its output as the next user message."""
    messages = _start()
    for turn in range(sampling.turns):
        messages += _text_turn(await _call(client, sampling, messages, tools=False), turn)
    return sampling.turns


COMPACT_KEEP = 2  # model turns (with their outputs) a compacting harness keeps


async def compacting_agent(client: Any, sampling: Sampling) -> int:
    """Text mode, but only the system prompt, the task and the last `COMPACT_KEEP` exchanges are kept."""
    head = _start()
    history: list[dict[str, Any]] = []
    for turn in range(sampling.turns):
        history += _text_turn(await _call(client, sampling, head + history, tools=False), turn)
        history = history[-2 * COMPACT_KEEP :]
    return sampling.turns


async def retrying_agent(client: Any, sampling: Sampling) -> int:
    """Tool mode, but every second call is sent twice (a timeout, say) and the first answer thrown away."""
    messages, calls = _start(), 0
    for turn in range(sampling.turns):
        if turn % 2:
            await _call(client, sampling, messages, tools=True)
            calls += 1
        messages += _tool_turn(await _call(client, sampling, messages, tools=True), turn)
        calls += 1
    return calls


HARNESSES: Mapping[str, ZooHarness] = {
    harness.name: harness
    for harness in (
        ZooHarness(name="tool_agent", run=tool_agent),
        ZooHarness(name="text_agent", run=text_agent),
        ZooHarness(name="compacting_agent", run=compacting_agent, rewrites_history=True),
        # A retry throws a model turn away: the row holding it ends there (a dead end) by design.
        ZooHarness(name="retrying_agent", run=retrying_agent, rewrites_history=True),
    )
}


def rewrites_history(template: str, harness: str) -> bool:
    """Whether the pair changes history before the last model turn (outside the token-in target)."""
    return TEMPLATES[template].rewrites_history or HARNESSES[harness].rewrites_history
