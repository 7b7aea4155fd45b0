"""Warm start: a short supervised pass on demonstrations before RL.

A randomly initialised policy over a small vocabulary learns very slowly from reward alone, so a
run can start from a model that imitated correct episodes for a few hundred steps. Only assistant
tokens carry loss; the chat template renders each conversation exactly as the gateway will.

Run it as `python -m harnessrl.trainer.warmstart --model DIR --demos FILE.jsonl --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

Conversation = list[dict[str, str]]
# A demonstration is a conversation, or {"messages": conversation, "tools": [...]} for tool calling.
Demonstration = Conversation | dict[str, Any]


def _parts(demo: Demonstration) -> tuple[Conversation, list[dict[str, Any]] | None]:
    if isinstance(demo, dict):
        return demo["messages"], demo.get("tools")
    return demo, None


def render(
    tokenizer: Any, messages: Conversation, tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask that is 1 exactly on assistant-produced tokens.

    `tools` are rendered the way the server renders a request that offers them.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:i], tools=tools, add_generation_prompt=True, tokenize=True
        )
        full = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=True)
        prompt, full = _ids(prompt), _ids(full)
        # ChatML adds a newline after <|im_end|>: it is template, not something the model samples.
        end = len(full) - 1 if tokenizer.decode(full[-1:]) == "\n" else len(full)
        mask += [0] * (len(prompt) - len(ids)) + [1] * (end - len(prompt)) + [0] * (len(full) - end)
        ids = full
    return ids, mask


def _ids(value: Any) -> list[int]:
    return list(value["input_ids"] if isinstance(value, dict) or hasattr(value, "keys") else value)


def batches(
    rows: list[tuple[list[int], list[int]]], size: int, pad: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One random right-padded batch: input ids, attention mask, loss mask."""
    chosen = rng.sample(rows, min(size, len(rows)))
    width = max(len(ids) for ids, _ in chosen)
    ids = torch.full((len(chosen), width), pad, dtype=torch.long)
    attention = torch.zeros((len(chosen), width), dtype=torch.long)
    loss = torch.zeros((len(chosen), width), dtype=torch.float32)
    for row, (tokens, mask) in enumerate(chosen):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        loss[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return ids, attention, loss


def train(
    model_dir: Path, demos: list[Conversation], out_dir: Path, steps: int, batch: int, lr: float
) -> dict[str, float]:
    """Imitate `demos` for `steps` steps and save the model and tokenizer to `out_dir`."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [render(tokenizer, *_parts(d)) for d in demos]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(0)  # noqa: S311 - reproducible batches, not security
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    start, loss_value = time.perf_counter(), float("nan")
    columns = (TextColumn("warm start"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"))
    with Progress(*columns, TimeRemainingColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task("warm", total=steps, loss="")
        for _ in range(steps):
            ids, attention, mask = batches(rows, batch, pad, rng)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            loss_value = float(loss.detach())
            progress.update(task, advance=1, loss=f"loss {loss_value:.3f}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for extra in ("generation_config.json",):
        if (model_dir / extra).exists() and not (out_dir / extra).exists():
            (out_dir / extra).write_bytes((model_dir / extra).read_bytes())
    return {"steps": steps, "final_loss": loss_value, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints one JSON line with the final loss and time."""
    parser = argparse.ArgumentParser(prog="python -m harnessrl.trainer.warmstart")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument(
        "--demos", type=Path, required=True, help="JSONL, one conversation (list of messages) a line"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    # One thread: on a small model extra OpenMP threads mostly spin, and collapse under contention.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    demos = [json.loads(line) for line in args.demos.read_text().splitlines() if line.strip()]
    result = train(args.model, demos, args.out, args.steps, args.batch, args.lr)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
