"""A thread-mode engine refit through `update_weights_from_tensor` with the payloads slime and
verl build for SGLang: the engine's weights become the trainer's, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from rollout_engine.protocol.sglang_payloads import read_refit_payload, refit_payload_cap
from tests.rollout_engine.compat.sglang_fakes import (
    FlattenedTensorMetadata,
    file_system_sharing,
    flattened_bucket,
    mp_serialize,
    sglang_modules,
    slime_payloads,
    verl_payload,
)


@pytest.fixture(autouse=True)
def _file_system():
    with file_system_sharing():
        yield


def _trainer_weights(model_path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New float32 values for every tensor of the checkpoint (what a train step produces)."""
    g = torch.Generator().manual_seed(seed)
    with safe_open(f"{model_path}/model.safetensors", "pt") as f:
        return [(name, torch.randn(f.get_slice(name).get_shape(), generator=g))
                for name in f.keys()]


def _engine_weight(engine, name: str, like: torch.Tensor) -> torch.Tensor:
    rows = like.shape[0] if like.dim() else 1
    return torch.tensor(engine.get_weights_by_name(name, truncate_size=rows), dtype=torch.float32)


def _assert_engine_has(engine, weights) -> None:
    for name, want in weights:
        got = _engine_weight(engine, name, want)
        assert got.shape == want.shape, name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name  # bit for bit


def _slime(weights, as_bytes=True):
    return slime_payloads(weights, as_bytes=as_bytes)


def _ours_as_sglang_dict(weights):
    """Our aligned layout (pack_buckets) described by SGLang metadata: padding between tensors."""
    from rollout_engine.protocol.bucket import pack_buckets

    (bucket,) = pack_buckets(weights, 1 << 30)
    metadata = [FlattenedTensorMetadata(m.name, torch.Size(m.shape), torch.float32, m.offset,
                                        m.offset + m.nbytes, m.nbytes) for m in bucket.metas]
    with sglang_modules():
        return [mp_serialize({"flattened_tensor": bucket.buffer, "metadata": metadata},
                             output_str=True)], bucket


@pytest.mark.parametrize(("build", "load_format"), [
    (lambda w: _slime(w, as_bytes=True), "flattened_bucket"),
    (lambda w: _slime(w, as_bytes=False), "flattened_bucket"),
    (_ours_as_sglang_dict, "flattened_bucket"),
    (lambda w: (verl_payload(w), None), None),
    (lambda w: (verl_payload(w, sglang_version="0.5.15"), None), None),
    (lambda w: (verl_payload(w, tp_size=2, other_ranks=b"never read"), None), "direct"),
], ids=["slime-uint8", "slime-per-dtype", "ours-aligned-in-sglang-dict", "verl",
        "verl-sglang-before-0.5.16", "verl-tp2"])
def test_refit_with_sglang_trainer_payloads(make_engine, qwen2_path, build, load_format):
    engine = make_engine(qwen2_path)
    weights = _trainer_weights(qwen2_path, seed=1)
    name, first = weights[0]
    assert not torch.equal(_engine_weight(engine, name, first), first)  # the refit must change it
    serialized, keep = build(weights)
    assert all(isinstance(s, str) for s in serialized)
    ok, message = engine.update_weights_from_tensor(serialized, load_format=load_format)
    assert ok, message
    del keep  # the trainer may reuse its buffers once the call returned
    _assert_engine_has(engine, weights)
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={
        "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    assert len(out["output_ids"]) == 2  # and it still serves


def test_slime_refit_in_several_buckets(make_engine, qwen2_path):
    """slime sends one call per bucket; together they cover every parameter."""
    engine = make_engine(qwen2_path)
    weights = _trainer_weights(qwen2_path, seed=2)
    half = len(weights) // 2
    for part in (weights[:half], weights[half:]):
        serialized, _keep = _slime(part)
        ok, message = engine.update_weights_from_tensor(serialized, load_format="flattened_bucket")
        assert ok, message
    _assert_engine_has(engine, weights)


def test_bad_sglang_payload_leaves_the_weights_alone(make_engine, qwen2_path):
    engine = make_engine(qwen2_path)
    name, before = _trainer_weights(qwen2_path, seed=3)[0]
    before = _engine_weight(engine, name, before)
    weights = _trainer_weights(qwen2_path, seed=4)
    bucket = flattened_bucket(weights)
    last = bucket["metadata"][-1]
    last.end_idx, last.numel = last.end_idx + 4, last.numel + 4  # past the end of the bucket
    with sglang_modules():
        serialized = [mp_serialize(bucket, output_str=True)]
    ok, message = engine.update_weights_from_tensor(serialized, load_format="flattened_bucket")
    assert not ok and "past the end of the flattened tensor" in message
    assert torch.equal(_engine_weight(engine, name, before), before)


def test_refit_payload_cap_follows_the_model(make_engine, qwen2_path):
    model = torch.nn.Linear(4, 4)  # 80 bytes of weights
    assert refit_payload_cap(model) == 4 * 80 + (64 << 20)
    huge = torch.zeros((64 << 20) // 4 + 1024)  # 64 MiB + 4 KiB: over the cap with the rest
    (data,) = verl_payload([("huge", huge), ("weight", torch.ones(4, 4))])
    with pytest.raises(ValueError, match="over this receiver's cap"):
        read_refit_payload(data, model)
    engine = make_engine(qwen2_path)
    (data,) = verl_payload([("model.norm.weight", huge)])  # under the engine's cap: its shape
    ok, message = engine.update_weights_from_tensor([data])  # is refused, not its size
    assert not ok and "model.norm.weight" in message
