"""`update_weights_from_distributed` off the loop: the engine posts a call's receives and keeps
serving, takes the next call while the first is still arriving (the bucketed trainer's
pipeline), applies them in order, and refuses what would race a receive (sleep, other refits)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_engine.weights.loader import iter_safetensors

NORM = "model.norm.weight"
EMB = "model.embed_tokens.weight"
Q = [5, 6, 7, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _receiving(engine) -> int:
    r = engine.tm.call("get_server_info", timeout=10)
    assert r.success, f"the scheduler is blocked: {r.message}"
    return r.result["weight_updates_receiving"]


def _joined(engine, group: str):
    """The trainer's side (rank 0) of a two-rank group `engine` joined as rank 1."""
    from rollout_engine.protocol.weight_broadcast import join_update_group
    from trainer_bridge.transports.group_ranks import free_port

    port, box = free_port(), {}
    joiner = threading.Thread(target=lambda: box.update(join=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name=group, backend="gloo")), daemon=True)
    joiner.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, group, "gloo", 60)
    joiner.join(60)
    assert box["join"][0], box
    return pg


def _call(engine, box: dict, key: str, *args, **kwargs) -> threading.Thread:
    t = threading.Thread(target=lambda: box.update(
        {key: engine.update_weights_from_distributed(*args, **kwargs)}), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_calls_are_received_off_the_loop_and_applied_in_order(w1_w2, make_engine, mode):
    engine = make_engine(w1_w2[0], scheduler_mode=mode)
    before = engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"]
    pg, box = _joined(engine, "g"), {}
    w2 = dict(iter_safetensors(w1_w2[1]))
    norm, emb = w2[NORM].contiguous(), w2[EMB].contiguous()
    first = _call(engine, box, "a", [NORM], ["float32"], [list(norm.shape)], group_name="g",
                  weight_version="a")
    _wait_for(lambda: _receiving(engine) == 1, "the first call's receives to be posted")
    # the loop is free while the trainer has not sent a byte yet
    assert engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"] == before
    for refused in (lambda: engine.release_memory_occupation(["weights"]),
                    lambda: engine.update_weights_from_disk(w1_w2[1])):
        ok, message = _result(refused)
        assert not ok and "being received" in message, message
    # the second call is taken (its receives posted) before the first has arrived
    second = _call(engine, box, "b", [EMB], ["float32"], [list(emb.shape)], group_name="g",
                   weight_version="b", flush_cache=True)
    _wait_for(lambda: _receiving(engine) == 2, "the second call's receives to be posted")
    pg.broadcast(norm).wait()
    pg.broadcast(emb).wait()
    first.join(60)
    second.join(60)
    assert box["a"][0] and box["b"][0], box
    assert _receiving(engine) == 0
    assert engine.get_weight_version() == "b"      # applied in order: "b" last
    assert engine.get_weights_by_name(NORM, truncate_size=4) == norm[:4].tolist()
    assert engine.get_weights_by_name(EMB, truncate_size=1) == emb[:1].tolist()
    # the receive buffers are free again: sleep and the group's teardown are allowed
    assert engine.release_memory_occupation(["kv_cache"])
    assert engine.resume_memory_occupation(["kv_cache"])
    assert engine.destroy_weights_update_group("g")[0]
    pg.shutdown()


def _result(call) -> tuple[bool, str]:
    """(ok, message) of an Engine call that either returns (ok, message) or raises."""
    try:
        out = call()
    except Exception as e:  # noqa: BLE001 - the refusal's text is what is checked
        return False, str(e)
    if isinstance(out, tuple):
        return bool(out[0]), str(out[1])
    return True, str(out)


def test_a_trainer_that_dies_mid_pipeline_changes_nothing(w1_w2, make_engine):
    """Two calls posted, the trainer sends part of the first and dies: both fail with the
    receive's error, the old weights keep serving bit for bit, and the buffers are reusable."""
    engine = make_engine(w1_w2[0], weight_update_group_timeout=3.0)
    before = engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"]
    norm_before = engine.get_weights_by_name(NORM, truncate_size=8)
    pg, box = _joined(engine, "g"), {}
    norm = torch.full_like(dict(iter_safetensors(w1_w2[1]))[NORM], 7.0)
    first = _call(engine, box, "a", [NORM, NORM + "_x"], ["float32", "float32"],
                  [list(norm.shape), [4]], group_name="g")
    second = _call(engine, box, "b", [NORM], ["float32"], [list(norm.shape)], group_name="g")
    _wait_for(lambda: _receiving(engine) == 2, "both calls' receives to be posted")
    pg.broadcast(norm).wait()      # the first call's first tensor only; then the trainer dies
    pg.shutdown()
    first.join(60)
    second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert not box["a"][0] and not box["b"][0], box
    assert _receiving(engine) == 0
    assert engine.get_weights_by_name(NORM, truncate_size=8) == norm_before
    assert engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"] == before
    engine.destroy_weights_update_group("g")
    # a new group's receive reuses the engine's buffers and applies
    pg, box = _joined(engine, "g2"), {}
    done = _call(engine, box, "c", [NORM], ["float32"], [list(norm.shape)], group_name="g2")
    pg.broadcast(norm).wait()
    done.join(60)
    assert box["c"][0], box
    assert engine.get_weights_by_name(NORM, truncate_size=1) == norm[:1].tolist()
    pg.shutdown()


def test_send_call_sends_now_and_answers_later_in_order(w1_w2, make_engine):
    """`Engine.send_call`: calls sent back to back without waiting reach the scheduler in the
    order sent (the last version wins), and each waiter returns what the method returns."""
    engine = make_engine(w1_w2[0], scheduler_mode="process")
    w2 = dict(iter_safetensors(w1_w2[1]))
    waiters = [engine.send_call("update_weights_from_tensor", [(NORM, w2[NORM] + i)],
                                weight_version=f"v{i}") for i in range(6)]
    answers = [w() for w in waiters]
    assert answers == [(True, f"updated to weight_version v{i}") for i in range(6)]
    assert engine.get_weight_version() == "v5"
    assert engine.get_weights_by_name(NORM, truncate_size=2) == (w2[NORM] + 5)[:2].tolist()
    bad = engine.send_call("update_weights_from_tensor", [("nope", w2[NORM])])
    ok, message = bad()
    assert not ok and "nope" in message, message
    with pytest.raises(ValueError, match="send_call"):
        engine.send_call("generate", [1, 2])


def test_gloo_threads_knob(monkeypatch):
    from rollout_engine.protocol.weight_broadcast import gloo_threads

    monkeypatch.delenv("ROLLOUT_ENGINE_GLOO_THREADS", raising=False)
    assert gloo_threads() == 8
    monkeypatch.setenv("ROLLOUT_ENGINE_GLOO_THREADS", "2")
    assert gloo_threads() == 2
    monkeypatch.setenv("ROLLOUT_ENGINE_GLOO_THREADS", "8")
    assert gloo_threads() == 8
    for bad in ("0", "x", "-1", "65"):
        monkeypatch.setenv("ROLLOUT_ENGINE_GLOO_THREADS", bad)
        with pytest.raises(ValueError, match="ROLLOUT_ENGINE_GLOO_THREADS"):
            gloo_threads()
