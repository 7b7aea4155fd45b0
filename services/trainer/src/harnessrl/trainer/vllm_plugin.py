"""vLLM general plugin: CPU linear layers compute with their live `weight`, so reloads take effect.

vLLM's CPU backend prepacks every unquantized linear weight into a kernel-specific copy after
loading (oneDNN or sgl-kernel) and drops `layer.weight`. A later `collective_rpc reload_weights`
(the CPU weight-sync path) then answers 200 while the layers keep computing with the old packed
copy, so a "synced" server silently serves stale weights. This plugin replaces that dispatch with
plain `torch.nn.functional.linear` on the unpacked weight, which a reload updates in place. The
tiny models this path serves lose nothing measurable; GPU platforms are left untouched.

Registered under the entry point group `vllm.general_plugins`, so every vLLM process started from
an environment with harnessrl-trainer installed (API server, engine core, workers) loads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MARK = "_harnessrl_plain_linear"


def register() -> None:
    """Patch vLLM's CPU GEMM dispatch (idempotent: vLLM may call this more than once)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _MARK, False):
        return
    utils.dispatch_cpu_unquantized_gemm = _keep_plain_weights(original)  # type: ignore[assignment]


def _keep_plain_weights(
    original: Callable[[torch.nn.Module, bool], None],
) -> Callable[[torch.nn.Module, bool], None]:
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            original(layer, remove_weight)  # conv and MoE expert weights keep vLLM's kernels
            return
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    setattr(dispatch, _MARK, True)
    return dispatch
