"""RL control plane, engine side: refit equivalence, sleep/wake, invalidation, atomicity,
busy/asleep errors, pause modes, endurance."""

from __future__ import annotations

import base64
import os
import pickle
import threading
import time
from typing import Any

import psutil
import pytest
import torch

from rollout_engine.protocol.bucket import pack_buckets
from rollout_engine.tokenizer_manager import EngineAsleepError, EngineBusyError
from rollout_engine.weights.loader import iter_safetensors

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60)), [3] * 17 + [99, 100]]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def w1_w2():
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def w2_reference(w1_w2):
    from rollout_engine import Engine

    with Engine(model_path=w1_w2[1], scheduler_mode="thread") as eng:
        return _run(eng)


@pytest.fixture(scope="module")
def proc_engine(w1_w2):
    """One engine whose scheduler is a real child process, shared by the refit tests; each test
    starts by reloading W1 from disk."""
    from rollout_engine import Engine

    with Engine(model_path=w1_w2[0], scheduler_mode="process") as eng:
        yield eng
        eng.check_integrity()


@pytest.fixture
def w1_engine(proc_engine, w1_w2):
    assert proc_engine.update_weights_from_disk(w1_w2[0], weight_version="w1")[0]
    return proc_engine


def _run(engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _same(a, b, tol: float = 1e-5) -> bool:
    return all(x[0] == y[0] and max(abs(p - q) for p, q in zip(x[1], y[1])) <= tol
               for x, y in zip(a, b))


def _w2_tensors(w2: str) -> list[tuple[str, torch.Tensor]]:
    return list(iter_safetensors(w2))


@pytest.mark.parametrize("how", ["disk", "tensor", "direct", "flattened_bucket"])
def test_refit_equivalence(how, w1_w2, w2_reference, w1_engine):
    w1, w2 = w1_w2
    engine = w1_engine
    before = _run(engine)
    assert not _same(before, w2_reference)
    if how == "disk":
        ok, msg = engine.update_weights_from_disk(w2, weight_version="w2")
    elif how == "flattened_bucket":
        buckets = list(pack_buckets(_w2_tensors(w2), bucket_bytes=1 << 18))
        assert len(buckets) > 1
        ok, msg = engine.update_weights_from_tensor(buckets, load_format="flattened_bucket",
                                                    weight_version="w2")
    else:
        ok, msg = engine.update_weights_from_tensor(
            _w2_tensors(w2), load_format=None if how == "tensor" else "direct",
            weight_version="w2")
    assert ok, msg
    assert _same(_run(engine), w2_reference)
    name = "model.layers.1.mlp.down_proj.weight"
    expected = dict(_w2_tensors(w2))[name][:3]
    assert torch.equal(torch.tensor(engine.get_weights_by_name(name, truncate_size=3)), expected)
    assert engine.get_model_info()["weight_version"] == "w2"


def _refit_over_gloo(engine, w2: str, load_format) -> None:
    """Play the trainer: rank 0 of a gloo group (joined the SGLang way) broadcasting W2 to the
    engine (rank 1)."""
    from rollout_engine.protocol.bucket import dtype_to_str
    from rollout_engine.protocol.weight_broadcast import flatten, join_update_group

    port = _free_port()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(init=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="g", backend="gloo")))
    t.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)
    t.join()
    assert result["init"][0], result
    tensors = _w2_tensors(w2)
    names = [n for n, _ in tensors]
    dtypes = [dtype_to_str(x.dtype) for _, x in tensors]
    shapes = [list(x.shape) for _, x in tensors]
    t = threading.Thread(target=lambda: result.update(upd=engine.update_weights_from_distributed(
        names, dtypes, shapes, group_name="g", load_format=load_format, weight_version="w2")))
    t.start()
    if load_format == "flattened_bucket":   # SGLang's bucket: bytes back to back
        pg.broadcast(flatten([x for _, x in tensors])).wait()
    else:
        for _, x in tensors:
            pg.broadcast(x.contiguous()).wait()
    t.join()
    assert result["upd"][0], result
    assert engine.destroy_weights_update_group("g")[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_refit_over_distributed(load_format, w1_w2, w2_reference, w1_engine):
    engine = w1_engine
    _refit_over_gloo(engine, w1_w2[1], load_format)
    assert _same(_run(engine), w2_reference)


def test_sleep_wake_refit_and_rss(w1_w2, w2_reference, make_engine):
    engine = make_engine(w1_w2[0], scheduler_mode="process", max_total_tokens=262144)
    _run(engine)
    info = engine.get_server_info()
    target = info["kv_pool_bytes"] + info["weight_bytes"]
    proc = psutil.Process(engine.tm.host.pid)
    rss_before = proc.memory_info().rss
    res = engine.release_memory_occupation()
    rss_after = proc.memory_info().rss
    assert res["bytes_freed"] == target
    assert rss_before - rss_after >= 0.9 * target, (rss_before, rss_after, target)
    with pytest.raises(EngineAsleepError):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    engine.resume_memory_occupation()
    with pytest.raises(EngineAsleepError, match="stale"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert engine.update_weights_from_tensor(_w2_tensors(w1_w2[1]))[0]
    assert _same(_run(engine), w2_reference)


def test_release_kv_only_keeps_outputs(w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    before = _run(engine)
    engine.release_memory_occupation(["kv_cache"])
    assert engine.get_server_info()["kv_cached_tokens"] == 0   # the radix tree was emptied
    engine.resume_memory_occupation(["kv_cache"])
    assert _same(_run(engine), before, tol=0.0)


def test_weights_cpu_backup_resumes_without_refit(w1_w2, make_engine):
    engine = make_engine(w1_w2[0], enable_weights_cpu_backup=True)
    before = _run(engine)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert _same(_run(engine), before, tol=0.0)


def test_refit_invalidates_cached_prefix(w1_w2, w2_reference, make_engine):
    engine = make_engine(w1_w2[0])
    engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    again = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] > 0
    assert engine.update_weights_from_disk(w1_w2[1], flush_cache=False)[0]
    after = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_logprob=True)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["output_ids"] == w2_reference[1][0]


def _malicious_payload(marker: str) -> str:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()


def _truncated_bucket(tensors) -> tuple[str, Any]:
    """A bucket whose buffer is shorter than its metadata says, built past the constructor's
    checks (as a hostile or buggy sender could) and serialized; with the lease that keeps its
    shared memory until the engine answered."""
    from rollout_engine.protocol.payload_sender import lend_named_tensors

    bucket = next(pack_buckets(tensors, bucket_bytes=1 << 30))
    short = object.__new__(type(bucket))
    object.__setattr__(short, "buffer", bucket.buffer[:bucket.metas[-1].offset].clone())
    object.__setattr__(short, "metas", bucket.metas)
    return lend_named_tensors(short)


def test_failed_refits_change_nothing(w1_w2, w1_engine, tmp_path):
    engine = w1_engine
    before = _run(engine)
    version = engine.get_weight_version()
    w2 = dict(_w2_tensors(w1_w2[1]))
    emb = "model.embed_tokens.weight"
    good = [(n, t) for n, t in w2.items() if n != emb]  # applied first would be a partial refit
    marker = tmp_path / "pwned"
    cases = {
        "unknown name": good + [("model.layers.99.mlp.up_proj.weight", w2[emb])],
        "wrong shape": good + [(emb, w2[emb][:-1])],
        "wrong dtype": good + [(emb, w2[emb].to(torch.int32))],   # floats would be cast
    }
    probe = ["model.norm.weight", "model.layers.0.self_attn.q_proj.bias", emb]
    weights_before = [engine.get_weights_by_name(n, truncate_size=1000) for n in probe]
    for why, payload in cases.items():
        ok, msg = engine.update_weights_from_tensor(payload)
        assert not ok, why
    truncated, lease = _truncated_bucket(list(w2.items())[:3])
    with lease:
        ok, msg = engine.update_weights_from_tensor([truncated], load_format="flattened_bucket")
    assert not ok and "truncated" in msg, msg
    ok, msg = engine.update_weights_from_tensor([_malicious_payload(str(marker))])
    assert not ok and "system" in msg, msg
    assert not marker.exists()
    ok, msg = engine.update_weights_from_disk(str(tmp_path / "missing"))
    assert not ok
    assert engine.get_weight_version() == version
    assert [engine.get_weights_by_name(n, truncate_size=1000) for n in probe] == weights_before
    assert _same(_run(engine), before)


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_busy_and_asleep_errors(w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    rid = "long-one"
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 400,
                                               "ignore_eos": True}, rid=rid)))
    t.start()
    wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 1)
    engine.pause_generation("in_place")   # it keeps its KV and cannot finish: busy for sure
    with pytest.raises(EngineBusyError):
        engine.release_memory_occupation()
    assert engine.tm.call("flush_cache").status == 409
    engine.continue_generation()
    t.join()
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "length"
    engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(EngineAsleepError):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]


LONG = 300


def _start_long(engine, n: int) -> tuple[list[threading.Thread], list]:
    outs: list = [None] * n

    def work(i: int) -> None:
        outs[i] = engine.generate(input_ids=PROMPTS[i % len(PROMPTS)], sampling_params={
            "temperature": 0, "max_new_tokens": LONG, "ignore_eos": True})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while engine.get_server_info()["num_running_reqs"] < n and time.time() < deadline:
        time.sleep(0.02)
    return threads, outs


def test_pause_abort(w1_w2, make_engine):
    engine = make_engine(w1_w2[0])
    threads, outs = _start_long(engine, 3)
    engine.pause_generation("abort")
    for t in threads:
        t.join()
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(len(o["output_ids"]) < LONG for o in outs)
    engine.continue_generation()
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_refit_continue(mode, w1_w2, w2_reference, make_engine):
    engine = make_engine(w1_w2[0])
    threads, outs = _start_long(engine, 3)
    engine.pause_generation(mode)
    info = engine.get_server_info()
    if mode == "retract":
        assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 3
        engine.release_memory_occupation()     # allowed: retracted requests hold no KV
        engine.resume_memory_occupation()
    else:
        assert info["num_running_reqs"] == 3
        with pytest.raises(EngineBusyError):
            engine.release_memory_occupation()
    assert engine.update_weights_from_disk(w1_w2[1], weight_version="v2")[0]
    engine.continue_generation()
    for t in threads:
        t.join()
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert len(o["output_ids"]) == LONG
        spans = o["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "v2"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == LONG
    assert _same(_run(engine), w2_reference)


def test_endurance_50_cycles(w1_w2, w1_engine):
    engine = w1_engine
    w2 = _w2_tensors(w1_w2[1])
    w1 = list(iter_safetensors(w1_w2[0]))
    proc = psutil.Process(engine.tm.host.pid)
    baseline = None
    for cycle in range(50):
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        assert engine.update_weights_from_tensor(w2 if cycle % 2 else w1)[0]
        engine.generate(input_ids=PROMPTS[0], sampling_params={"temperature": 0,
                                                               "max_new_tokens": 2})
        if cycle == 4:
            baseline = proc.memory_info().rss
    engine.check_integrity()
    assert proc.memory_info().rss <= baseline * 1.05, (proc.memory_info().rss, baseline)
