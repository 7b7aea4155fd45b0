"""The vLLM plugin makes CPU linears compute with their live weight (what a reload updates)."""

import torch
from vllm.model_executor.layers import utils

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
