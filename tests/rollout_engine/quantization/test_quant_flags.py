"""``--quantization``: SGLang's and vLLM's flag reach EngineConfig.quantization; unknown
methods, contradictions with the checkpoint and combinations it is not run with are
ValueErrors naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest

from rollout_engine.compat.server_args import to_engine_kwargs
from rollout_engine.compat.vllm_args import vllm_to_engine_kwargs
from rollout_engine.compat.vllm_flags import UnsupportedVllmFlagError
from rollout_engine.config import EngineConfig
from rollout_engine.testing.quantized_checkpoint import write_quantized
from rollout_engine.testing.tiny_moe import tiny_moe_path


def test_sglang_and_vllm_flags_map_to_the_field(qwen2_path):
    kwargs, _ = to_engine_kwargs({"quantization": "w8a8_int8"}, {})
    assert kwargs["quantization"] == "w8a8_int8"
    kwargs, _ = vllm_to_engine_kwargs({"quantization": "fp8"})
    assert kwargs["quantization"] == "fp8"
    kwargs, _ = vllm_to_engine_kwargs({"quantization": "compressed-tensors"})
    assert kwargs.get("quantization") is None          # the checkpoint names its scheme
    with pytest.raises(UnsupportedVllmFlagError, match="--quantization"):
        vllm_to_engine_kwargs({"quantization": "awq"})
    assert EngineConfig(model_path=qwen2_path, quantization="fp8").quantization == "fp8"


@pytest.mark.parametrize("flags,match", [
    ({"quantization": "awq"}, r"EngineConfig.quantization: 'awq' is not implemented"),
    ({"quantization": "fp8", "tp_size": 2}, r"EngineConfig.quantization: 'fp8' is not "
                                             r"implemented with tp_size > 1"),
    ({"quantization": "w8a8_int8", "enable_lora": True, "max_lora_rank": 8,
      "lora_target_modules": ["q_proj"]},
     r"EngineConfig.quantization: 'w8a8_int8' is not implemented with LoRA"),
])
def test_bad_combinations_are_refused(qwen2_path, flags, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model_path=qwen2_path, **flags)


def test_mixture_of_experts_is_refused():
    with pytest.raises(ValueError, match=r"EngineConfig.quantization: 'fp8' is not implemented "
                                         r"for mixture-of-experts models"):
        EngineConfig(model_path=str(tiny_moe_path("qwen3_moe")), quantization="fp8")


def test_the_checkpoint_names_its_method(qwen2_path, tmp_path):
    path = write_quantized(qwen2_path, tmp_path / "int8", "w8a8_int8")
    assert EngineConfig(model_path=str(path)).quantization is None   # read by the runner
    EngineConfig(model_path=str(path), quantization="w8a8_int8")     # repeating it is fine
    with pytest.raises(ValueError, match=r"EngineConfig.quantization: 'fp8' contradicts the "
                                         r"checkpoint, whose tensors are 'w8a8_int8'"):
        EngineConfig(model_path=str(path), quantization="fp8")


def test_an_unknown_checkpoint_scheme_is_refused(qwen2_path, tmp_path):
    path = tmp_path / "awq"
    shutil.copytree(qwen2_path, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"EngineConfig.quantization: the checkpoint's "
                                         r"quantization_config names quant_method 'awq'"):
        EngineConfig(model_path=str(path))
