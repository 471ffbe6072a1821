"""A quantized engine refitted the way the RL frameworks do it over HTTP: slime brackets the
update with ``/post_process_weights``, miles with ``/begin_weight_update`` /
``/end_weight_update``, and broadcasts go through a weight-update group. Each ends with the
weights (SGLang's checker checksums, per checkpoint name: int8 weights and scales) and the
greedy outputs of an engine that loaded W2 quantized from disk."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.testing.quantized_checkpoint import write_quantized
from rollout_engine.testing.tiny_model import tiny_model_path
from rollout_engine.weights.loader import iter_safetensors

PROMPTS = [[5, 9, 30, 31], [7] * 12]
GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


def _client(engine: Any) -> Any:
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    return TestClient(create_app(engine))


def _checksums(c: Any) -> dict[str, str]:
    r = c.post("/weights_checker", json={"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()["ranks"][0]["checksums"]


def _outputs(engine: Any) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _tensor_update(c: Any, named: list[tuple[str, torch.Tensor]]) -> Any:
    return c.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(named)], "flush_cache": True})


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
def test_slime_and_miles_bracket_a_quantized_refit(method, w1_w2, make_engine, tmp_path):
    w1, w2 = w1_w2
    reference = make_engine(str(write_quantized(w2, tmp_path / method, method)))
    engine = make_engine(w1, quantization=method)
    w1_tensors, w2_tensors = list(iter_safetensors(w1)), list(iter_safetensors(w2))
    with _client(reference) as ref, _client(engine) as c:
        expected = _checksums(ref)
        assert any(name.endswith("_scale") for name in expected) == (method == "w8a8_int8")
        assert _checksums(c) != expected
        # slime: restore before the update, post-process after it
        r = c.post("/post_process_weights", json={"restore_weights_before_load": True,
                                                  "post_process_quantization": False})
        assert r.status_code == 200 and r.json()["result"] == {"quantization": method}, r.text
        assert _tensor_update(c, w2_tensors).json()["success"]
        r = c.post("/post_process_weights", json={"post_process_quantization": True})
        assert r.status_code == 200, r.text
        assert _checksums(c) == expected
        assert _outputs(engine) == _outputs(reference)
        # miles: a session around each update; a refused one inside it changes nothing
        assert c.post("/begin_weight_update", json={}).status_code == 200
        bad = w1_tensors + [("model.layers.0.mlp.up_proj.weight_scale", torch.ones(128, 1))]
        r = _tensor_update(c, bad)
        assert r.status_code == 400 and "up_proj" in r.text, r.text
        assert _checksums(c) == expected
        assert _tensor_update(c, w1_tensors).json()["success"]
        assert c.post("/end_weight_update", json={}).status_code == 200
        assert _checksums(c) != expected
        assert c.post("/begin_weight_update", json={}).status_code == 200
        assert _tensor_update(c, w2_tensors).json()["success"]
        assert c.post("/end_weight_update", json={}).status_code == 200
        assert _checksums(c) == expected
        r = c.post("/post_process_weights", json={"post_load_weights": [1]})
        assert r.status_code == 400 and "post_load_weights" in r.text, r.text


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
def test_a_broadcast_refit_is_quantized_on_arrival(method, w1_w2, make_engine, tmp_path):
    """fp8's parameters are float32 like the announced tensors, which an unquantized model
    would receive straight into spare parameters (``weights/shadow.py``): here they are
    staged and converted."""
    from rollout_engine.protocol.weight_broadcast import join_update_group
    from trainer_bridge.transports.group_ranks import free_port

    w1, w2 = w1_w2
    reference = make_engine(str(write_quantized(w2, tmp_path / "q", method)))
    engine = make_engine(w1, quantization=method)
    port, box = free_port(), {}
    joiner = threading.Thread(target=lambda: box.update(j=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="g", backend="gloo")), daemon=True)
    joiner.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)
    joiner.join(60)
    tensors = [(n, t.contiguous()) for n, t in iter_safetensors(w2)]
    t = threading.Thread(target=lambda: box.update(r=engine.update_weights_from_distributed(
        [n for n, _ in tensors], ["float32"] * len(tensors), [list(x.shape) for _, x in tensors],
        group_name="g")), daemon=True)
    t.start()
    for _, x in tensors:
        pg.broadcast(x).wait()
    t.join(60)
    assert box["r"][0], box
    with _client(reference) as ref, _client(engine) as c:
        assert _checksums(c) == _checksums(ref)
    assert _outputs(engine) == _outputs(reference)
    assert engine.destroy_weights_update_group("g")[0]
    pg.shutdown()


@pytest.mark.parametrize("method,weights", [("w8a8_int8", 40), ("fp8", 26)])
def test_a_wake_without_backup_waits_for_every_weight_and_scale(method, weights, w1_w2,
                                                                make_engine):
    """The colocated loop: sleep, wake without a backup (every weight stale, the int8 scales
    counted as weights), one refit of the trainer's float tensors writes them all."""
    w1, _ = w1_w2
    engine = make_engine(w1, quantization=method, enable_memory_saver=True)
    before = _outputs(engine)
    engine.release_memory_occupation()
    woke = engine.resume_memory_occupation()
    assert woke["weights_stale"] and woke["weights_missing"] == weights
    ok, message = engine.update_weights_from_tensor(list(iter_safetensors(w1)))
    assert ok, message
    assert engine.get_server_info()["weights_missing"] == 0
    assert _outputs(engine) == before
