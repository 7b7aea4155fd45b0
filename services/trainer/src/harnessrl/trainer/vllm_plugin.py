"""vLLM general plugin: CPU linear layers compute with their live `weight`, so reloads take effect.

vLLM's CPU backend prepacks every unquantized linear weight into a kernel-specific copy after
loading (oneDNN or sgl-kernel) and drops `layer.weight`. A later `collective_rpc reload_weights`
(the CPU weight-sync path) then answers 200 while the layers keep computing with the old packed
copy, so a "synced" server silently serves stale weights. This plugin replaces that dispatch with
plain `torch.nn.functional.linear` on the unpacked weight, which a reload updates in place. The
tiny models this path serves lose nothing measurable; GPU platforms are left untouched.

With `FORK_ENGINE_ENV` set to "1" (the local stack's `VllmServer` sets it, with one worker in
the engine process: `--distributed-executor-backend uni`), it also lets vLLM *fork* its engine
process. The CPU platform forces `spawn` so that each worker process can set up OpenMP before torch
starts; with no worker process there is nothing to set up, and a spawned engine only imports vLLM
and torch again. Measured on 2 cores with the tiny model: 31 s to `/health` with spawn and a worker
process, 21 s with the worker in the engine, 13 s forked.

Registered under the entry point group `vllm.general_plugins`, so every vLLM process started from
an environment with harnessrl-trainer installed (API server, engine core, workers) loads it. It
imports nothing of harnessrl (the vLLM image installs this package alone) and torch only when vLLM
dispatches a layer (`harnessrl.stack.vllm` reads `FORK_ENGINE_ENV` without paying for torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Set ("1") in a CPU vLLM server's environment by whoever starts it with a single in-process worker.
FORK_ENGINE_ENV = "HRL_VLLM_FORK_ENGINE"
_MARK = "_harnessrl_plain_linear"


def register() -> None:
    """Patch vLLM's CPU GEMM dispatch (idempotent: vLLM may call this more than once)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if not getattr(original, _MARK, False):
        utils.dispatch_cpu_unquantized_gemm = _keep_plain_weights(original)  # type: ignore[assignment]
    if os.environ.get(FORK_ENGINE_ENV) == "1":
        _fork_the_engine()


def _fork_the_engine() -> None:
    """After the CPU platform's config check (which sets `spawn`), keep `fork` for a uni executor."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config
    if getattr(check, _MARK, False):
        return

    def check_and_fork(cls: type[CpuPlatform], vllm_config: Any) -> None:
        check.__func__(cls, vllm_config)  # type: ignore[attr-defined]
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    setattr(check_and_fork, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_fork)  # type: ignore[method-assign,assignment]


def _keep_plain_weights(
    original: Callable[[torch.nn.Module, bool], None],
) -> Callable[[torch.nn.Module, bool], None]:
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        import torch

        weight = layer.weight
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            original(layer, remove_weight)  # conv and MoE expert weights keep vLLM's kernels
            return
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    setattr(dispatch, _MARK, True)
    return dispatch
