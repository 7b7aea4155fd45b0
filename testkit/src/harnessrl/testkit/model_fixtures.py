"""Pytest fixtures for the tiny model and a real vLLM CPU server on it (one per test session).

Re-exported by `harnessrl.testkit.plugin`; usable alone with
`pytest -p harnessrl.testkit.model_fixtures`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.stack.vllm import VllmServer


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Return the default tiny Qwen3 chat model's directory (built once per machine)."""
    # Imported here: torch and transformers take seconds to import, and this plugin loads in every
    # test session, most of which never ask for the model.
    from harnessrl.stack.demo.tiny_model import cached_tiny_model

    return cached_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """Serve `tiny_model` from a real vLLM CPU server for the whole session.

    Attributes: `.url` (base URL, no `/v1`), `.model` (served model name), `.model_dir`,
    `.log_file`. Tests that change its weights must restore them (see the trainer's tests).
    """
    server = VllmServer(tiny_model, log_file=tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    yield server
    server.stop()


# --- a model whose chat template rewrites history (token-in mode's test model) ---------------------

# The default tiny model's ChatML + hermes template, with two rewrites real templates make: earlier
# assistant turns lose their reasoning (Qwen3 drops `<think>...</think>`), and tool-call arguments
# are rendered again with `tojson` (`{"a": 1}`), whatever JSON the model sampled (`{"a":1}`).
REWRITING_TEMPLATE = """\
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
{%- set content = message.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant' }}
{%- if content %}{{- '\\n' + content }}{%- endif %}
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


def with_chat_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    """A copy of `model_dir` (weights, tokenizer) whose chat template is `template`; returns `out_dir`."""
    import shutil

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


@pytest.fixture(scope="session")
def rewriting_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with `REWRITING_TEMPLATE`: its next prompt never re-renders what it sampled."""
    return with_chat_template(tiny_model, tmp_path_factory.mktemp("rewriting-model"), REWRITING_TEMPLATE)
