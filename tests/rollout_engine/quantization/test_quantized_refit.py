"""Refits of a quantized model: the engine quantizes what a trainer sends in the copy, so a
refit of W2's float tensors (any path) gives the very bytes of W2 loaded quantized from disk;
already-quantized pairs load as they are; a refused update leaves every weight bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_engine.config import EngineConfig
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.quantization import fp8, int8
from rollout_engine.testing.quantized_checkpoint import decoder_linear, write_quantized
from rollout_engine.testing.tiny_model import tiny_model_path
from rollout_engine.weights import refit
from rollout_engine.weights.loader import iter_safetensors, load_weights

METHODS = ("w8a8_int8", "fp8")


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def quantized_w2(w1_w2, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    return {m: str(write_quantized(w1_w2[1], root / m, m)) for m in METHODS}


def _runner(path: str, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                    max_total_tokens=64, quantization=quantization))


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


def _assert_same(runner: ModelRunner, expected: dict[str, torch.Tensor]) -> None:
    got = dict(runner.model.named_parameters())
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def _send(runner: ModelRunner, tensors: list[tuple[str, torch.Tensor]]) -> None:
    refit.refit_from_serialized(runner.model, [serialize_named_tensors(tensors)], None)


@pytest.mark.parametrize("method", METHODS)
def test_every_refit_path_gives_the_quantized_checkpoints_bytes(method, w1_w2, quantized_w2):
    w1, w2 = w1_w2
    expected = _state(_runner(quantized_w2[method]))   # W2 read quantized from disk
    runner = _runner(w1, method)
    layer = runner.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == (torch.int8 if method == "w8a8_int8" else torch.float32)
    tensors = list(iter_safetensors(w2))
    _send(runner, tensors)                                     # update_weights_from_tensor
    _assert_same(runner, expected)
    refit.refit_from_disk(runner.model, w1)
    refit.refit_from_disk(runner.model, w2)                    # update_weights_from_disk
    _assert_same(runner, expected)
    refit.refit_from_disk(runner.model, w1)
    refit.refit_from_disk(runner.model, quantized_w2[method])  # ... of a quantized checkpoint
    _assert_same(runner, expected)
    refit.refit_from_disk(runner.model, w1)
    load_weights(runner.model, tensors)                        # a broadcast's received tensors
    _assert_same(runner, expected)


@pytest.mark.parametrize("method", METHODS)
def test_bf16_tensors_quantize_as_their_bf16_checkpoint(method, w1_w2, tmp_path):
    w1, w2 = w1_w2
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in Path(w2).iterdir():
        if not f.name.endswith(".safetensors"):
            (bf16 / f.name).write_bytes(f.read_bytes())
    tensors = [(n, t.to(torch.bfloat16)) for n, t in iter_safetensors(w2)]
    save_file(dict(tensors), str(bf16 / "model.safetensors"))
    expected = _state(_runner(str(write_quantized(bf16, tmp_path / "q", method))))
    runner = _runner(w1, method)
    _send(runner, tensors)
    _assert_same(runner, expected)


def _quantized_pairs(method: str, path: str) -> list[tuple[str, torch.Tensor]]:
    """What a trainer that quantizes sends: each linear as (weight, its scale)."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in iter_safetensors(path):
        if not decoder_linear(name):
            out.append((name, t))
        elif method == "w8a8_int8":
            q, scale = int8.quantize_weight_int8(t)
            out += [(name, q), (name + "_scale", scale)]
        else:
            q, scale_inv = fp8.quantize_blocks(t)
            out += [(name, q), (name + "_scale_inv", scale_inv)]
    return out


@pytest.mark.parametrize("method", METHODS)
def test_already_quantized_pairs_load_as_they_are(method, w1_w2, quantized_w2):
    expected = _state(_runner(quantized_w2[method]))
    runner = _runner(w1_w2[0], method)
    _send(runner, _quantized_pairs(method, w1_w2[1]))
    _assert_same(runner, expected)


def _bad_updates(method: str, w2: str) -> dict[str, list[tuple[str, torch.Tensor]]]:
    pairs = _quantized_pairs(method, w2)
    floats = list(iter_safetensors(w2))
    name = "model.layers.1.mlp.down_proj.weight"
    scale = name + ("_scale" if method == "w8a8_int8" else "_scale_inv")
    by = dict(pairs)
    return {
        "weight without its scale": [p for p in pairs if p[0] != scale],
        "scale without its weight": [p for p in pairs if p[0] != name],
        "float weight with a scale": floats + [(scale, by[scale])],
        "wrong dtype": floats[:-1] + [(name, torch.zeros_like(by[name], dtype=torch.int32))],
        "scale of the wrong shape": [(n, torch.cat((t, t)) if n == scale else t)
                                     for n, t in pairs],
    }


@pytest.mark.parametrize("case", ["weight without its scale", "scale without its weight",
                                  "float weight with a scale", "wrong dtype",
                                  "scale of the wrong shape"])
@pytest.mark.parametrize("method", METHODS)
def test_a_refused_quantized_refit_leaves_every_weight(method, case, w1_w2):
    runner = _runner(w1_w2[0], method)
    x = torch.randn(3, runner.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = runner.model.layers[1].mlp.gate_up_proj
    before, out_before = _state(runner), layer(x)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        _send(runner, _bad_updates(method, w1_w2[1])[case])
    _assert_same(runner, before)
    assert torch.equal(layer(x), out_before)


@pytest.mark.parametrize("method", METHODS)
def test_a_resent_payload_is_quantized_again_with_its_new_values(method, w1_w2):
    """A trainer resending the same shared memory after an in-place optimizer step: the
    engine keeps the payload mapped (``refit.MappedStorages``) but converts the new values,
    never replays the tensors it converted the first time."""
    runner = _runner(w1_w2[0], method)
    tensors = [(n, t.clone()) for n, t in iter_safetensors(w1_w2[1])]
    mapped = refit.MappedStorages(1 << 30)
    text = serialize_named_tensors(tensors)
    refit.refit_from_serialized(runner.model, [text], None, mapped=mapped)
    first = _state(runner)
    for _, t in tensors:
        t.mul_(0.5).add_(0.01)                        # in place: the same storages
    assert serialize_named_tensors(tensors) == text
    refit.refit_from_serialized(runner.model, [text], None, mapped=mapped)
    assert mapped.num_payloads == 1                   # read from the mapping again
    expected = _runner(w1_w2[0], method)
    load_weights(expected.model, tensors)
    _assert_same(runner, _state(expected))
    assert not torch.equal(runner.model.layers[0].mlp.down_proj.weight,
                           first["layers.0.mlp.down_proj.weight"])   # new values, converted
