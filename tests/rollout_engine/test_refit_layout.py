"""A refit writes into the parameters' own storage: same addresses, strides and contiguity as
the first load (a layout change would compute differently and break CUDA graphs), and the
values bit for bit those of a fresh load of the same checkpoint."""

from __future__ import annotations

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.testing.tiny_model import tiny_model_path
from rollout_engine.weights import refit
from rollout_engine.weights.loader import iter_safetensors


def _runner(path: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                    max_total_tokens=64))


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    return {n: (p.data_ptr(), p.stride(), p.is_contiguous(), p.dtype)
            for n, p in model.named_parameters()}


def test_refit_keeps_layout_and_copies_exactly():
    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    runner = _runner(w1)
    fresh = dict(_runner(w2).model.named_parameters())
    before = _layout(runner.model)
    assert all(contiguous for _, _, contiguous, _ in before.values())

    refit.refit_from_disk(runner.model, w2)
    assert _layout(runner.model) == before
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, fresh[name]), name

    refit.refit_from_disk(runner.model, w1)
    tensors = list(iter_safetensors(w2))   # alive until the refit read them
    payload = serialize_named_tensors(tensors)
    refit.refit_from_serialized(runner.model, [payload], None)
    assert _layout(runner.model) == before
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, fresh[name]), name
