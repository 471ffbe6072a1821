"""RL control plane under racing calls: no stale KV after a refit whatever the label,
no zeroed weights after a partial refit, control calls that honour their timeout, no request
left waiting forever, a rendezvous that does not stop serving, a bounded weight read."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from rollout_engine.control import handlers, rl_control
from rollout_engine.memory.prefix_cache import CacheNamespace
from rollout_engine.memory.radix_cache import RadixCache
from rollout_engine.protocol.bucket import pack_buckets
from rollout_engine.tokenizer_manager import EngineAsleepError
from rollout_engine.weights.loader import iter_safetensors

P = list(range(20, 80))                      # 60 tokens: the prompt whose KV must not go stale
Q = [7, 8, 9, 10, 11, 12, 13, 14, 15]
LONG_PROMPT = [3] * 17 + [99, 100]
GREEDY = {"temperature": 0, "max_new_tokens": 8}
LONG = {"temperature": 0, "max_new_tokens": 1900, "ignore_eos": True}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def w2_outputs(w1_w2) -> dict[str, list[int]]:
    """What a fresh engine on W2 answers: the reference for every post-refit output."""
    from rollout_engine import Engine

    with Engine(model_path=w1_w2[1], scheduler_mode="thread", dtype="float32",
                device="cpu") as eng:
        return {name: eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
                for name, ids in (("P", P), ("Q", Q), ("LONG", LONG_PROMPT))}


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _start(engine, ids, params, rid: str) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=ids, sampling_params=params, rid=rid)), daemon=True)
    t.start()
    return t, box


def _info(engine) -> dict:
    return engine.get_server_info()


def _long_request_paused_in_place(engine) -> tuple[threading.Thread, dict]:
    """A long request that holds KV computed under the current weights, frozen in place."""
    t, box = _start(engine, LONG_PROMPT, LONG, "long")
    _wait_for(lambda: _info(engine)["num_running_reqs"] == 1, "the long request to run")
    engine.pause_generation("in_place")
    return t, box


# -- 1. every weight change moves the cache namespace ------------------------------------------
def test_refit_under_the_same_label_never_serves_stale_kv(w1_w2, w2_outputs, make_engine):
    engine = make_engine(w1_w2[0])
    engine.generate(input_ids=P, sampling_params=GREEDY)            # P cached under W1
    t, box = _long_request_paused_in_place(engine)
    label = engine.get_weight_version()
    r = engine.tm.call("update_weights_from_disk", model_path=w1_w2[1], weight_version=label)
    assert r.success, r.message
    assert r.result["weight_version"] == label
    engine.continue_generation()
    again = engine.generate(input_ids=P, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == w2_outputs["P"]
    assert _info(engine)["num_running_reqs"] == 1                  # W1's request still decodes
    engine.check_integrity()
    engine.abort_request("long")
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    # its KV (computed under W1) was freed, not cached under the new weights
    long_again = engine.generate(input_ids=LONG_PROMPT, sampling_params=GREEDY)
    assert long_again["meta_info"]["cached_tokens"] == 0
    assert long_again["output_ids"] == w2_outputs["LONG"]
    engine.check_integrity()


def test_busy_flush_is_deferred_until_idle(w1_w2, w2_outputs, make_engine):
    engine = make_engine(w1_w2[0])
    t, box = _long_request_paused_in_place(engine)
    r = engine.tm.call("update_weights_from_disk", model_path=w1_w2[1], flush_cache=True)
    assert r.success and r.result["flush_deferred"] is True, r
    engine.continue_generation()
    assert engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"] == w2_outputs["Q"]
    info = _info(engine)
    assert info["num_running_reqs"] == 1 and info["kv_cached_tokens"] > 0  # Q is cached
    engine.abort_request("long")
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert _info(engine)["kv_cached_tokens"] == 0                  # the flush ran once idle
    engine.check_integrity()


def test_one_tensor_refit_under_the_same_label_moves_the_namespace(w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    engine.generate(input_ids=P, sampling_params=GREEDY)
    w2_norm = dict(iter_safetensors(w1_w2[1]))[NORM]
    ok, msg = engine.update_weights_from_tensor([(NORM, w2_norm)], flush_cache=False,
                                                weight_version=engine.get_weight_version())
    assert ok, msg
    assert engine.generate(input_ids=P, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


def test_relabel_keeps_the_cache(w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    first = engine.generate(input_ids=P, sampling_params=GREEDY)
    assert engine.update_weight_version("renamed") == "renamed"
    again = engine.generate(input_ids=P, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(P) - 1     # all but the last token
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["weight_version"] == "renamed"


class _Allocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, slots) -> None:
        self.freed.extend(torch.as_tensor(slots).tolist())


def test_retired_generation_frees_its_nodes_once_unlocked():
    alloc = _Allocator()
    cache = RadixCache(alloc)
    old = CacheNamespace(0)
    cache.insert([1, 2, 3, 4], torch.arange(4), old)
    held = cache.match_prefix([1, 2, 3], old)       # a running request locks [1, 2, 3]
    cache.inc_lock_ref(held.node)
    assert cache.retire_generations_before(1) == 1   # the unlocked [4] goes at once
    # the old request finishes and hands over its KV: it must not survive as a cache entry
    cache.insert([1, 2, 3, 7, 8], torch.tensor([0, 1, 2, 10, 11]), old)
    cache.dec_lock_ref(held.node)
    assert cache.total_size() == 0 and sorted(alloc.freed) == [0, 1, 2, 3, 10, 11]
    cache.check_integrity()
    cache.insert([5, 6], torch.tensor([20, 21]), CacheNamespace(1))
    assert cache.match_prefix([5, 6], CacheNamespace(1)).matched_len == 2


# -- 2. a partial refit after a wake does not make zeroed weights usable -------------------------
def test_partial_refit_after_wake_keeps_refusing(w1_w2, w2_outputs, make_engine):
    engine = make_engine(w1_w2[0])
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    tensors = list(iter_safetensors(w1_w2[1]))
    buckets = list(pack_buckets(tensors, bucket_bytes=1 << 16))
    assert len(buckets) > 2
    for i, bucket in enumerate(buckets[:-1]):
        ok, msg = engine.update_weights_from_tensor([bucket], load_format="flattened_bucket",
                                                    flush_cache=False,
                                                    weight_version=f"step-1.partial{i}")
        assert ok, msg
        left = len(tensors) - sum(len(b.metas) for b in buckets[:i + 1])
        with pytest.raises(EngineAsleepError, match=f"{left} of {len(tensors)} weights"):
            engine.generate(input_ids=P, sampling_params=GREEDY)
        assert _info(engine)["weights_missing"] == left
    ok, msg = engine.update_weights_from_tensor([buckets[-1]], load_format="flattened_bucket",
                                                weight_version="step-1")
    assert ok, msg
    assert _info(engine)["weights_stale"] is False
    assert engine.generate(input_ids=P, sampling_params=GREEDY)["output_ids"] == w2_outputs["P"]


# -- 3. control calls honour their timeout ------------------------------------------------------
@pytest.fixture
def blocking_call(monkeypatch):
    """A control call ``block`` that holds the scheduler until ``gate`` is set."""
    gate, started = threading.Event(), threading.Event()

    def rpc_block() -> dict:
        started.set()
        gate.wait(60)
        return {"blocked": True}

    table = handlers.handler_table
    monkeypatch.setattr(handlers, "handler_table",
                        lambda *parts: {**table(*parts), "block": rpc_block})
    yield gate, started
    gate.set()


def test_timed_out_call_that_had_not_started_is_cancelled(w1_w2, make_engine, blocking_call):
    gate, started = blocking_call
    engine = make_engine(w1_w2[0])
    blocker = threading.Thread(target=lambda: engine.tm.call("block", timeout=60), daemon=True)
    blocker.start()
    assert started.wait(30)
    r = engine.tm.call("update_weight_version", timeout=0.2, new_version="too-late")
    assert r.status == 504
    gate.set()
    blocker.join(30)
    assert engine.get_weight_version() == "default"           # it never ran
    assert "may have run" in r.message and "get_weight_version" in r.message, r
    assert engine.tm.control.stats["cancelled_after_timeout"] == 1
    assert engine.tm.control.stats["ran_after_timeout"] == 0


def test_call_that_ran_past_its_timeout_is_reported(w1_w2, make_engine, blocking_call):
    gate, started = blocking_call
    engine = make_engine(w1_w2[0])
    box: dict = {}
    caller = threading.Thread(target=lambda: box.update(r=engine.tm.call("block", timeout=3)))
    caller.start()
    assert started.wait(30)
    caller.join(30)
    assert box["r"].status == 504 and "may" in box["r"].message
    gate.set()
    engine.get_weight_version()                # answered after the late result of `block`
    assert engine.tm.control.stats["ran_after_timeout"] == 1
    assert engine.tm.control.stats["timed_out"] == 1


# -- 4. continue_generation cannot leave queued requests waiting forever ------------------------
@pytest.mark.parametrize("state", ["stale", "asleep"])
def test_continue_while_unservable_refuses_queued_requests(state, w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    engine.pause_generation("abort")
    queued = [_start(engine, ids, GREEDY, f"q{i}") for i, ids in enumerate((P, Q))]
    _wait_for(lambda: _info(engine)["num_waiting_reqs"] == 2, "two queued requests")
    engine.release_memory_occupation(None if state == "stale" else ["kv_cache"])
    if state == "stale":
        engine.resume_memory_occupation()
    result = engine.continue_generation()
    assert result["refused"] == 2
    for t, box in queued:
        t.join(30)
        assert not t.is_alive(), "a queued request was left waiting"
        reason = box["out"]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and state in reason["message"], reason
    if state == "asleep":
        engine.resume_memory_occupation(["kv_cache"])
        assert engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"]


# -- 5. the update-group rendezvous neither blocks serving nor waits two minutes ----------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_does_not_block_other_requests(w1_w2, make_engine):
    from rollout_engine.protocol.weight_broadcast import join_update_group

    engine = make_engine(w1_w2[0])
    port, box = _free_port(), {}
    joiner = threading.Thread(target=lambda: box.update(r=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="g", backend="gloo")), daemon=True)
    joiner.start()

    def pending() -> bool:
        r = engine.tm.call("get_server_info", timeout=10)
        assert r.success, f"the scheduler is blocked: {r.message}"
        return "g" in r.result["pending_weight_update_groups"]

    _wait_for(pending, "the rendezvous to start")
    out = engine.generate(input_ids=Q, sampling_params=GREEDY)      # served during the wait
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert joiner.is_alive()
    pg = join_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)   # the SGLang way
    joiner.join(60)
    assert box["r"][0], box
    w2_norm = dict(iter_safetensors(w1_w2[1]))[NORM].contiguous()
    upd: dict = {}
    t = threading.Thread(target=lambda: upd.update(r=engine.update_weights_from_distributed(
        [NORM], ["float32"], [list(w2_norm.shape)], group_name="g")))
    t.start()
    pg.broadcast(w2_norm).wait()
    t.join(60)
    assert upd["r"][0], upd
    assert engine.get_weights_by_name(NORM, truncate_size=4) == w2_norm[:4].tolist()
    assert engine.destroy_weights_update_group("g")[0]


def test_rendezvous_timeout_is_short_and_names_the_missing_side(w1_w2, make_engine):
    import torch.distributed as dist

    engine = make_engine(w1_w2[0], weight_update_group_timeout=1.0)
    port = _free_port()
    start = time.monotonic()
    ok, msg = engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g",
                                               backend="gloo")
    assert not ok and "trainer" in msg and f"127.0.0.1:{port}" in msg, msg
    assert time.monotonic() - start < 20
    # the trainer's store is up, but the other engine of a world of 3 never joins
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    ok, msg = engine.init_weights_update_group("127.0.0.1", port, 1, 3, group_name="g",
                                               backend="gloo")
    assert not ok and "did not all join" in msg and "rank 0" in msg, msg
    assert engine.generate(input_ids=Q, sampling_params=GREEDY)["output_ids"]
    del store


# -- 6. get_weights_by_name is bounded and admin-only -------------------------------------------
def test_get_weights_by_name_is_bounded(w1_w2, make_engine, monkeypatch):
    engine = make_engine(w1_w2[0])
    emb = "model.embed_tokens.weight"
    assert len(engine.get_weights_by_name(emb, truncate_size=3)) == 3
    for bad in (rl_control.MAX_TRUNCATE_ROWS + 1, 0, -1, "10"):
        with pytest.raises(ValueError, match="truncate_size"):
            engine.get_weights_by_name(emb, truncate_size=bad)
    monkeypatch.setattr(rl_control, "MAX_WEIGHT_ELEMENTS", 64 * 4)
    assert len(engine.get_weights_by_name(emb, truncate_size=4)) == 4
    with pytest.raises(ValueError, match="elements"):
        engine.get_weights_by_name(emb, truncate_size=5)


def test_get_weights_by_name_needs_the_admin_key(w1_w2, make_engine):
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    app = create_app(make_engine(w1_w2[0]), admin_api_key="admin-key")
    body = {"name": NORM, "truncate_size": 2}
    with TestClient(app) as c:
        assert c.post("/get_weights_by_name", json=body).status_code == 401
        assert c.get("/get_weights_by_name", params=body).status_code == 401
        admin = {"Authorization": "Bearer admin-key"}
        r = c.post("/get_weights_by_name", json=body, headers=admin)
        assert r.status_code == 200 and len(r.json()["result"]) == 2, r.text
        r = c.post("/get_weights_by_name", json={**body, "truncate_size": 5000}, headers=admin)
        assert r.status_code == 400 and "1024" in r.json()["error"]["message"], r.text
