"""The flat CPU decode loop (`models/cpu_decode.py`) on a quantized model: its linears run
their own product there too, so the hidden states equal the module path's bit for bit."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.models.cpu_decode import CpuDecodeForward
from rollout_engine.models.quant_linear import Fp8Linear, Int8Linear
from tests.rollout_engine.model_runner.test_flat_decode import _both, _decode_batch


@pytest.mark.parametrize("method,layer", [("w8a8_int8", Int8Linear), ("fp8", Fp8Linear)])
def test_flat_decode_of_a_quantized_model_equals_the_module_path(tiny_paths, method, layer):
    runner = ModelRunner(EngineConfig(model_path=tiny_paths["llama"], device="cpu",
                                      dtype="float32", max_total_tokens=4096,
                                      max_running_requests=80, quantization=method))
    assert isinstance(runner.flat_decode, CpuDecodeForward)
    assert isinstance(runner.model.layers[0].mlp.down_proj, layer)
    for batch, group in ((1, 1), (33, 8), (64, 1)):
        fb = _decode_batch(runner, batch, group, torch.Generator().manual_seed(batch))
        ref, got = _both(runner, fb)
        assert torch.equal(got, ref)
