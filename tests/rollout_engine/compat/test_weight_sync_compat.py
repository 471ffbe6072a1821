"""Refit as SGLang does it: floating dtypes cast on every path (integer / bool mismatches still
refused), ``weight_version`` unchanged unless given, and every field of SGLang's update
request dataclasses (``io_struct.py``) accepted by the routes and the Python methods.

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

from rollout_engine.protocol.payload_sender import serialize_named_tensors
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
    with pytest.raises(ValueError, match="weight_version"):
        _raise(engine.update_weights_from_tensor(items[:1], weight_version=8))


def _raise(result: tuple[bool, str]) -> None:
    ok, msg = result
    if not ok:
        raise ValueError(msg)


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
    engine.update_weight_version("v1", abort_all_requests=False)
    engine.abort_request("queued")
    t.join(30)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["weight_version"] == "v1" and meta["weight_versions"] == []   # no token sampled
    engine.continue_generation()


def _wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# -- 4. every field of SGLang's update dataclasses ------------------------------------------------
# UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
# UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput,
# DestroyWeightsUpdateGroupReqInput, UpdateWeightVersionReqInput: every field at SGLang's
# default, plus BaseReq's rid / http_worker_ipc
BASE = {"rid": None, "http_worker_ipc": None}
SGLANG_DEFAULTS = {
    "/update_weights_from_disk": {
        "load_format": None, "abort_all_requests": False, "weight_version": None,
        "is_async": False, "torch_empty_cache": False, "keep_pause": False,
        "recapture_cuda_graph": False, "token_step": 0, "flush_cache": True, "manifest": None},
    "/update_weights_from_tensor": {
        "load_format": None, "flush_cache": True, "abort_all_requests": False,
        "weight_version": None, "disable_draft_model": None, "torch_empty_cache": False},
    "/update_weights_from_distributed": {
        "group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
        "weight_version": None, "load_format": None, "torch_empty_cache": False},
    "/destroy_weights_update_group": {"group_name": "weight_update_group"},
    "/update_weight_version": {"abort_all_requests": True},
}


@pytest.fixture
def http(make_engine, qwen2_path):
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    engine = make_engine(qwen2_path, weight_version="v0")
    with TestClient(create_app(engine)) as client:
        yield engine, client


def _required(route: str, w2_path: str, w2) -> dict:
    return {
        "/update_weights_from_disk": {"model_path": w2_path},
        "/update_weights_from_tensor": {
            "serialized_named_tensors": [serialize_named_tensors([(NORM, w2[NORM])])]},
        "/update_weights_from_distributed": {"names": [NORM], "dtypes": ["float32"],
                                             "shapes": [[64]]},
        "/destroy_weights_update_group": {},
        "/update_weight_version": {"new_version": "v1"},
    }[route]


@pytest.mark.parametrize("route", list(SGLANG_DEFAULTS))
def test_every_sglang_field_at_its_default_is_accepted(http, route, w2_path, w2):
    engine, c = http
    body = {**_required(route, w2_path, w2), **SGLANG_DEFAULTS[route], **BASE}
    if route.startswith("/update_weights_from"):
        body["pp_rank"] = None      # ours: one pipeline stage, so null or 0
    r = c.post(route, json=body)
    message = r.json().get("message", "")
    if route in ("/update_weights_from_distributed", "/destroy_weights_update_group"):
        # accepted, then refused for what it is: there is no such group
        assert r.status_code == 400 and "no weight update group" in message, r.text
    else:
        assert r.status_code == 200 and r.json()["success"], r.text
    assert set(r.json()) >= {"success", "message"}
    r = c.post(route, json={**body, "no_such_field": 1})
    assert r.status_code == 400 and "no_such_field" in r.text, r.text


def test_init_weights_update_group_takes_sglangs_fields(http):
    from tests.rollout_engine.compat.test_slime_distributed import _free_port

    engine, c = http
    port, box = _free_port(), {}
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "http-group", "backend": "gloo", **BASE}
    t = threading.Thread(target=lambda: box.update(r=c.post("/init_weights_update_group",
                                                            json=body)))
    t.start()
    group = join_update_group("127.0.0.1", port, 0, 2, "http-group", "gloo", 60)
    t.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["success"], box["r"].text
    r = c.post("/destroy_weights_update_group", json={"group_name": "http-group", **BASE})
    assert r.status_code == 200 and r.json()["success"], r.text
    group.shutdown()


@pytest.mark.parametrize("route,field,value,why", [
    ("/update_weights_from_disk", "is_async", True, "is_async"),
    ("/update_weights_from_disk", "manifest", {"a": 1}, "manifest"),
    ("/update_weights_from_disk", "token_step", -1, "token_step"),
    ("/update_weights_from_tensor", "pp_rank", 1, "one pipeline stage"),
    ("/update_weights_from_disk", "pp_rank", 2, "one pipeline stage"),
    # "yes" is true to SGLang's pydantic model (and so here); "perhaps" is no boolean to either
    ("/update_weights_from_tensor", "abort_all_requests", "perhaps", "abort_all_requests"),
    ("/update_weights_from_tensor", "http_worker_ipc", "ipc://x", "http_worker_ipc"),
    ("/update_weights_from_tensor", "weight_version", 3, "weight_version"),
])
def test_a_value_we_cannot_honour_is_refused_naming_the_field(http, w2_path, w2, route, field,
                                                              value, why):
    engine, c = http
    r = c.post(route, json={**_required(route, w2_path, w2), field: value})
    assert r.status_code == 400 and why in r.text, r.text
    assert engine.get_weight_version() == "v0"
    assert engine.get_weights_by_name(NORM, truncate_size=64) != w2[NORM].tolist()


def test_flags_we_honour(http, w2_path, w2):
    engine, c = http
    body = {"model_path": w2_path, "pp_rank": 0, "torch_empty_cache": True,
            "recapture_cuda_graph": True, "token_step": 12, "keep_pause": True}
    r = c.post("/update_weights_from_disk", json=body)
    assert r.status_code == 200, r.text
    info = engine.get_server_info()
    assert info["paused"] and info["weight_version"] == "v0"     # keep_pause; no version given
    engine.continue_generation()
    assert engine.get_weights_by_name(NORM, truncate_size=64) == w2[NORM].tolist()
    r = c.post("/update_weights_from_tensor", json={
        **_required("/update_weights_from_tensor", w2_path, w2), "disable_draft_model": True,
        "weight_version": "v2"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert engine.get_weight_version() == "v2"


@pytest.mark.parametrize("method", ["tensor", "disk", "distributed", "version"])
def test_abort_all_requests_aborts_before_the_update(make_engine, qwen2_path, w2, w2_path,
                                                     method):
    engine = make_engine(qwen2_path)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1500,
                                           "ignore_eos": True}, rid="long")))
    t.start()
    _wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 1)
    if method == "tensor":
        ok, msg = engine.update_weights_from_tensor([(NORM, w2[NORM])], abort_all_requests=True)
    elif method == "disk":
        ok, msg = engine.update_weights_from_disk(w2_path, abort_all_requests=True)
    elif method == "distributed":
        ok, msg = _broadcast_refit_aborting(engine, [(NORM, w2[NORM])])
    else:
        ok, msg = True, engine.update_weight_version("relabel")   # SGLang's default: abort
    assert ok, msg
    t.join(30)
    meta = box["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 1500
    assert engine.get_server_info()["num_running_reqs"] == 0


def _broadcast_refit_aborting(engine, tensors):
    from tests.rollout_engine.compat.test_slime_distributed import _free_port

    port, box = _free_port(), {}
    t = threading.Thread(target=lambda: box.update(init=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="abort-group", backend="gloo")))
    t.start()
    group = join_update_group("127.0.0.1", port, 0, 2, "abort-group", "gloo", 60)
    t.join()
    t = threading.Thread(target=lambda: box.update(upd=engine.update_weights_from_distributed(
        [n for n, _ in tensors], ["float32"] * len(tensors), [x.shape for _, x in tensors],
        group_name="abort-group", abort_all_requests=True)))
    t.start()
    for _, x in tensors:
        group.broadcast(x).wait()
    t.join()
    engine.destroy_weights_update_group("abort-group")
    group.shutdown()
    return box["upd"]


def test_update_weight_version_can_keep_running_requests(make_engine, qwen2_path):
    engine = make_engine(qwen2_path)
    engine.pause_generation(mode="in_place")
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=engine.generate(
        input_ids=PROMPT, sampling_params=GREEDY)))
    t.start()
    _wait_until(lambda: engine.get_server_info()["num_waiting_reqs"] == 1)
    assert engine.update_weight_version("kept", abort_all_requests=False) == "kept"
    engine.continue_generation()
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert box["out"]["meta_info"]["weight_version"] == "kept"
