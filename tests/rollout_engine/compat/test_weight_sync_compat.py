"""Refit as SGLang does it: floating dtypes cast on every path (integer / bool mismatches still
refused) and ``weight_version`` unchanged unless given.

SGLang's weight loaders end in ``param.data.copy_(loaded_weight)`` (model_loader/weight_utils
``default_weight_loader``), so a bf16 trainer refits an fp32 engine; its HTTP server sets
``weight_version`` only ``if obj.weight_version is not None`` (entrypoints/http_server.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from rollout_engine.protocol.weight_broadcast import flatten, join_update_group
from rollout_engine.weights.loader import iter_safetensors

PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = {"temperature": 0, "max_new_tokens": 4}
NORM = "model.norm.weight"
EMB = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def w2_path() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def w2(w2_path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(w2_path))


def _weights(engine, names) -> dict[str, torch.Tensor]:
    """The engine's weights as float32 (exact for fp32, bf16 and fp16 parameters)."""
    out = {}
    for n in names:
        rows = engine.get_weights_by_name(n, truncate_size=1024)
        out[n] = torch.tensor(rows, dtype=torch.float32)
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float().view(torch.int32),
                                              b.float().view(torch.int32))


# -- 1. floating dtypes are cast ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_trainer_refits_an_fp32_engine(make_engine, qwen2_path, w2, dtype):
    engine = make_engine(qwen2_path)                 # float32
    sent = {n: t.to(dtype) for n, t in w2.items()}
    ok, msg = engine.update_weights_from_tensor(list(sent.items()), weight_version="half")
    assert ok, msg
    got = _weights(engine, w2)
    for n, t in sent.items():
        assert _bits_equal(got[n], t.float()), n     # exactly t.float(): the cast is lossless
    assert engine.get_weight_version() == "half"


def test_an_fp32_master_refits_a_bf16_engine(make_engine, qwen2_path, w2):
    engine = make_engine(qwen2_path, dtype="bfloat16")
    ok, msg = engine.update_weights_from_tensor(list(w2.items()))   # float32 tensors
    assert ok, msg
    got = _weights(engine, w2)
    for n, t in w2.items():
        assert _bits_equal(got[n], t.to(torch.bfloat16)), n   # rounded as copy_ rounds


def test_a_bf16_checkpoint_refits_an_fp32_engine_from_disk(make_engine, qwen2_path, w2,
                                                           tmp_path):
    engine = make_engine(qwen2_path)
    save_file({n: t.to(torch.bfloat16) for n, t in w2.items()}, str(tmp_path / "model.safetensors"))
    ok, msg = engine.update_weights_from_disk(str(tmp_path))
    assert ok, msg
    got = _weights(engine, w2)
    assert all(_bits_equal(got[n], t.to(torch.bfloat16).float()) for n, t in w2.items())


def _broadcast_refit(engine, tensors, load_format, port_group: str):
    """Rank 0 of a gloo group joined the SGLang way, broadcasting ``tensors`` (one buffer, back
    to back, for flattened_bucket) while the engine receives them in the dtypes declared."""
    from tests.rollout_engine.compat.test_slime_distributed import _free_port

    port, box = _free_port(), {}
    t = threading.Thread(target=lambda: box.update(init=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name=port_group, backend="gloo")))
    t.start()
    group = join_update_group("127.0.0.1", port, 0, 2, port_group, "gloo", 60)
    t.join()
    assert box["init"][0], box
    t = threading.Thread(target=lambda: box.update(upd=engine.update_weights_from_distributed(
        [n for n, _ in tensors], [x.dtype for _, x in tensors], [x.shape for _, x in tensors],
        group_name=port_group, load_format=load_format)))
    t.start()
    sends = [flatten([x for _, x in tensors])] if load_format else [x for _, x in tensors]
    for x in sends:
        group.broadcast(x).wait()
    t.join()
    assert engine.destroy_weights_update_group(port_group)[0]
    group.shutdown()
    return box["upd"]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_a_broadcast_is_received_as_declared_then_cast(make_engine, qwen2_path, w2,
                                                       load_format):
    engine = make_engine(qwen2_path)
    # mixed dtypes in one call (and one bucket): bf16, fp16 and fp32 tensors
    kinds = [torch.bfloat16, torch.float16, torch.float32]
    sent = [(n, t.to(kinds[i % 3])) for i, (n, t) in enumerate(sorted(w2.items()))]
    ok, msg = _broadcast_refit(engine, sent, load_format, "cast-group")
    assert ok, msg
    got = _weights(engine, w2)
    for n, t in sent:
        assert _bits_equal(got[n], t.float()), n


@pytest.mark.parametrize("path", ["tensor", "distributed", "disk"])
@pytest.mark.parametrize("bad_dtype", [torch.int32, torch.bool])
def test_an_integer_or_bool_mismatch_is_refused_and_changes_nothing(
        make_engine, qwen2_path, w2, tmp_path, path, bad_dtype):
    engine = make_engine(qwen2_path)
    before = _weights(engine, w2)
    version = engine.get_weight_version()
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    # every other weight is good and comes first: a partial write would show
    payload = [(n, t) for n, t in sorted(w2.items()) if n != EMB] + [(EMB, w2[EMB].to(bad_dtype))]
    if path == "tensor":
        ok, msg = engine.update_weights_from_tensor(payload)
    elif path == "distributed":
        ok, msg = _broadcast_refit(engine, payload, None, "bad-group")
    else:
        save_file(dict(payload), str(tmp_path / "model.safetensors"))
        ok, msg = engine.update_weights_from_disk(str(tmp_path), weight_version="bad")
    assert not ok
    assert EMB in msg and str(bad_dtype) in msg and "torch.float32" in msg, msg
    after = _weights(engine, w2)
    assert all(_bits_equal(after[n], before[n]) for n in w2)
    assert engine.get_weight_version() == version
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == out


# -- 3. weight_version: unchanged unless given ---------------------------------------------------
def test_an_update_without_a_version_keeps_the_version(make_engine, qwen2_path, w2, w2_path):
    engine = make_engine(qwen2_path, weight_version="7")
    items = sorted(w2.items())
    # verl: one call per bucket, none names a version; SGLang leaves it alone every time
    for bucket in (items[:10], items[10:]):
        assert engine.update_weights_from_tensor(bucket)[0]
        assert engine.get_weight_version() == "7"
    assert engine.update_weights_from_disk(w2_path)[0]
    assert engine.get_weight_version() == "7"
    assert _broadcast_refit(engine, items[:3], None, "v-group")[0]
    assert engine.get_weight_version() == "7"
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["meta_info"]["weight_version"] == "7"
    assert engine.update_weights_from_tensor(items[:1], weight_version="step-8")[0]
    assert engine.get_weight_version() == "step-8"


def test_a_response_without_tokens_still_names_the_version(make_engine, qwen2_path):
    engine = make_engine(qwen2_path, weight_version="v0")
    out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert out["meta_info"]["weight_version"] == "v0" and out["output_ids"] == []
    # queued while paused, then aborted: it never ran, yet it reports the serving version
    engine.pause_generation(mode="in_place")
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=PROMPT, sampling_params=GREEDY, rid="queued")))
    t.start()
    _wait_until(lambda: engine.get_server_info()["num_waiting_reqs"] == 1)
    engine.update_weight_version("v1")
    engine.abort_request("queued")
    t.join(30)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["weight_version"] == "v1" and meta["weight_versions"] == ["v1"]
    engine.continue_generation()


def _wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
