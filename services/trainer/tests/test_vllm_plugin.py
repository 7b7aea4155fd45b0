"""The vLLM plugin makes CPU linears compute with their live weight (what a reload updates)."""

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers import utils
from vllm.platforms.cpu import CpuPlatform

from harnessrl.trainer import vllm_plugin


def test_cpu_linears_keep_their_weight_and_use_plain_linear() -> None:
    vllm_plugin.register()
    patched = utils.dispatch_cpu_unquantized_gemm
    vllm_plugin.register()
    assert utils.dispatch_cpu_unquantized_gemm is patched

    layer = torch.nn.Linear(64, 32, bias=False)
    weight = layer.weight
    utils.dispatch_cpu_unquantized_gemm(layer, True)
    assert layer.weight is weight
    x = torch.randn(3, 64)
    with torch.no_grad():
        weight.add_(1.0)
        assert torch.equal(utils.cpu_unquantized_gemm(layer, x, layer.weight), x @ weight.T)


def test_a_uni_executor_keeps_fork_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    def platform_check(cls: type[CpuPlatform], vllm_config: object) -> None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # what the CPU platform does

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(platform_check))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")

    def method_after(backend: str) -> str:
        config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
        CpuPlatform.check_and_update_config(config)  # type: ignore[arg-type]
        return os.environ["VLLM_WORKER_MULTIPROC_METHOD"]

    monkeypatch.delenv(vllm_plugin.FORK_ENGINE_ENV, raising=False)
    vllm_plugin.register()
    assert method_after("uni") == "spawn"  # not asked: vLLM's choice stands
    monkeypatch.setenv(vllm_plugin.FORK_ENGINE_ENV, "1")
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: one wrapper
    assert method_after("uni") == "fork"
    assert method_after("mp") == "spawn"  # worker processes set up OpenMP: they are spawned
