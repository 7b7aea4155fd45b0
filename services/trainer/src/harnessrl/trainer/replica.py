"""Client for one vLLM replica's admin routes: weight reload, weight version, pause, probes.

The routes exist only when the replica runs with `VLLM_SERVER_DEV_MODE=1` (as
`harnessrl.stack.vllm.VllmServer` starts it). On CPU, weight sync is a checkpoint reload:
`reload_from` asks every worker to `reload_weights` from a directory in Hugging Face format, then
drops the prefix cache so no KV computed with the old weights is reused. The reload only takes
effect with the `harnessrl.trainer.vllm_plugin` plugin installed (see its docstring), so callers
verify a sync with `probe_logprobs`, never by the HTTP 200 alone, and label the weights
(`set_weight_version`) only after that check passed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import aiohttp
import msgspec

from harnessrl.shared.log import get_logger
from harnessrl.trainer.errors import ReplicaError

PauseMode = Literal["abort", "wait", "keep"]
log = get_logger(__name__)


class LogprobProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica computed for a fixed token sequence.

    `prompt[i]` is log p(prompt_token_ids[i + 1] | prompt_token_ids[: i + 1]); `tokens` are the
    greedy continuation and `completion` their logprobs.
    """

    prompt: list[float]
    tokens: list[int]
    completion: list[float]


class VllmReplica:
    """Async client for one vLLM server (`base_url` without `/v1`) serving `model`."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> VllmReplica:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        """One admin call: the decoded JSON answer, or `ReplicaError` for a status other than 200.

        Every call opens its own connection (`force_close`): vLLM's server drops the connection
        after a 500 (a failed worker RPC), and a pooled one would fail the next POST, such as the
        `resume` after a failed reload, leaving the replica paused. Admin calls are a handful
        per sync, so keep-alive saves nothing worth that.
        """
        if self._session is None:
            connector = aiohttp.TCPConnector(force_close=True)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        url = f"{self.base_url}{path}"
        async with self._session.request(method, url, json=json, params=params) as response:
            body = await response.text()
            if response.status != 200:
                raise ReplicaError(f"{method} {path} -> {response.status}: {body[:500]}")
            return msgspec.json.decode(body) if body else None

    async def reload_from(self, checkpoint_dir: Path | str) -> None:
        """Load new weights from `checkpoint_dir` (safetensors, HF layout) into every worker.

        Running requests are preempted and recomputed with the new weights; the prefix cache is
        emptied. Use `reload_frozen` when no token may be sampled from mixed weights. A reload
        that fails (an unreadable checkpoint) leaves vLLM 0.31's weights on the meta device: the
        replica's next forward kills its engine (measured), so it must be restarted.
        """
        path = _absolute(checkpoint_dir)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._call("POST", "/collective_rpc", json=rpc)
        reset = await self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (reset or {}).get("success"):
            raise ReplicaError(f"prefix cache not reset after reload: {reset!r}")
        log.info("replica.reloaded", replica=self.base_url, checkpoint=path)

    async def reload_frozen(self, checkpoint_dir: Path | str) -> None:
        """`reload_from` with scheduling frozen (`pause("keep")`) so no token mixes two weight sets.

        Requests in flight are held and recomputed with the new weights after the resume; new ones
        queue. The replica is resumed even when the reload fails, so a failed sync never leaves it
        paused. The weight label is left alone: `weight_sync` sets it only once the probe passed,
        and the probe can only run after the resume (a paused replica schedules nothing).
        """
        await self.pause("keep")
        try:
            await self.reload_from(checkpoint_dir)
        finally:
            await self.resume()

    async def set_weight_version(self, version: int | str) -> None:
        """Label the weights the replica now serves (reported by `weight_info`)."""
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    async def weight_info(self) -> str | None:
        """Return the weight version label last set, or None before the first."""
        info = await self._call("GET", "/weight_info")
        version = info.get("weight_version")
        return None if version is None else str(version)

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling: `keep` freezes in-flight requests, `wait` drains, `abort` cancels."""
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """Resume scheduling after `pause`."""
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        """Return whether the replica is paused."""
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def probe_logprobs(self, prompt_token_ids: Sequence[int], n_tokens: int = 0) -> LogprobProbe:
        """Score `prompt_token_ids` and greedily continue it by `n_tokens` tokens."""
        body = {
            "model": self.model,
            "prompt": list(prompt_token_ids),
            "max_tokens": max(n_tokens, 1),
            "temperature": 0.0,
            "logprobs": 0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        choice = (await self._call("POST", "/v1/completions", json=body))["choices"][0]
        scored = choice["prompt_logprobs"][1:]
        prompt = [
            float(entry[str(t)]["logprob"]) for entry, t in zip(scored, prompt_token_ids[1:], strict=True)
        ]
        return LogprobProbe(
            prompt=prompt,
            tokens=list(choice["token_ids"][:n_tokens]),
            completion=[float(x) for x in choice["logprobs"]["token_logprobs"][:n_tokens]],
        )


def _absolute(path: Path | str) -> str:
    """`path` made absolute against our working directory (the replica's may differ)."""
    return str(Path(path).absolute())


async def wait_serving(urls: Sequence[str], timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Wait until every replica's `/health` answers 200, for up to `timeout_s`; the ones still down."""
    deadline = time.monotonic() + timeout_s
    down = list(urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while down:
            down = [url for url in down if not await _healthy(session, url)]
            if not down or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)
    return down


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url.rstrip('/')}/health") as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
