"""The LoRA HTTP surface: SGLang's load / unload / load-from-tensors routes behind the admin key,
``lora_path`` on /generate and the OpenAI routes, the OpenAI ``model`` naming an adapter (or
``base:adapter``), ``/v1/models`` listing adapters, 400 for a bad adapter or an unknown name
(nothing changed), and ``/abort_request`` ending a LoRA request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.http_server import create_app
from rollout_engine.protocol.tensor_payload import lend_named_tensors
from tests.rollout_engine.lora.adapters import adapter_tensors, prompts

ADMIN = {"Authorization": "Bearer admin-key"}
GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture
def served(make_engine: Callable[..., Any], qwen2_path: str,
           adapters: dict[str, str]) -> Iterator[tuple[Any, TestClient]]:
    engine = make_engine(qwen2_path, enable_lora=True, max_lora_rank=8,
                         lora_target_modules=["all"], served_model_name="tiny")
    with TestClient(create_app(engine, admin_api_key="admin-key")) as client:
        yield engine, client


def _ok(r: Any) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def _generate(client: TestClient, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return _ok(client.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY,
                                              **fields}))


def test_routes_load_serve_list_and_unload(served: tuple[Any, TestClient],
                                           adapters: dict[str, str], vocab: int) -> None:
    engine, client = served
    body = {"lora_name": "a", "lora_path": adapters["all8"]}
    assert client.post("/load_lora_adapter", json=body).status_code == 401   # admin only
    answer = _ok(client.post("/load_lora_adapter", json=body, headers=ADMIN))
    assert answer["success"] is True and set(answer["loaded_adapters"]) == {"a"}
    assert answer["loaded_adapters"]["a"]["lora_path"] == adapters["all8"]
    cards = _ok(client.get("/v1/models"))["data"]
    assert [c["id"] for c in cards] == ["tiny", "a"]
    assert cards[1]["parent"] == "tiny" and cards[1]["root"] == adapters["all8"]

    prompt = prompts(vocab, [11], seed=1)[0]
    want = engine.generate(input_ids=prompt, lora_path="a", sampling_params=GREEDY)
    base = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert want["output_ids"] != base["output_ids"]
    assert _generate(client, prompt, lora_path="a")["output_ids"] == want["output_ids"]
    both = _generate(client, [prompt, prompt], lora_path=[None, "a"])
    assert [r["output_ids"] for r in both] == [base["output_ids"], want["output_ids"]]
    refused = client.post("/generate", json={"input_ids": prompt, "lora_path": "nope"})
    assert refused.status_code == 400 and "no adapter named 'nope'" in refused.text

    def completion(**fields: Any) -> str:
        r = _ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0, **fields}))
        return r["choices"][0]["text"]

    assert completion(model="a") == want["text"]
    assert completion(model="tiny:a") == want["text"]            # SGLang's base:adapter
    assert completion(model="tiny", lora_path="a") == want["text"]
    assert completion(model="tiny") == base["text"]
    assert completion(model="anything-else") == base["text"]
    bad = client.post("/v1/completions", json={"prompt": prompt, "model": "tiny:nope"})
    assert bad.status_code == 400 and "no adapter named 'nope'" in bad.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    by_model = _ok(client.post("/v1/chat/completions", json={**chat, "model": "a"}))
    by_path = _ok(client.post("/v1/chat/completions", json={**chat, "lora_path": "a"}))
    assert by_model["choices"][0]["message"] == by_path["choices"][0]["message"]

    missing = client.post("/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN)
    assert missing.status_code == 400 and "no adapter named 'b'" in missing.json()["message"]
    assert _ok(client.post("/unload_lora_adapter", json={"lora_name": "a"},
                           headers=ADMIN))["loaded_adapters"] == {}
    assert [c["id"] for c in _ok(client.get("/v1/models"))["data"]] == ["tiny"]


def test_load_from_tensors_route_and_its_refusals(served: tuple[Any, TestClient],
                                                  adapters: dict[str, str]) -> None:
    engine, client = served
    config, named = adapter_tensors(adapters["all8"])
    text, lease = lend_named_tensors(named)
    body = {"lora_name": "t", "config_dict": config, "serialized_tensors": text}
    with lease:
        assert _ok(client.post("/load_lora_adapter_from_tensors", json=body,
                               headers=ADMIN))["loaded_adapters"]["t"]["lora_path"] == "__tensor__"
        # later SGLang releases: serialized_named_tensors, one payload per tensor-parallel rank
        _ok(client.post("/load_lora_adapter_from_tensors", headers=ADMIN, json={
            **body, "lora_name": "t2", "serialized_tensors": None,
            "serialized_named_tensors": [text]}))
        for fields, status, message in [
                ({"lora_name": "u", "config_dict": None}, 400, "missing required field(s) "
                 "['config_dict']"),
                ({"lora_name": "u", "config_dict": {**config, "r": 16}}, 400,
                 "above this engine's max_lora_rank (8)"),
                ({"lora_name": "u", "added_tokens_config": {"x": 1}}, 400, "added_tokens_config"),
                ({"lora_name": "t"}, 400, "already loaded"),
                ({"lora_name": "u", "load_format": "flattened_bucket"}, 400, "flattened_bucket"),
                ({"lora_name": "u", "bogus": 1}, 400, "unknown field(s) 'bogus'"),
                ({"lora_name": "u", "serialized_tensors": None}, 400,
                 "give the payload as serialized_tensors or as serialized_named_tensors"),
                ({"lora_name": "u", "serialized_named_tensors": [text]}, 400, "(one of them)"),
                ({"lora_name": "u", "serialized_tensors": None,
                  "serialized_named_tensors": [text, text]}, 400, "this engine has one, got 2"),
                ({"lora_name": "u", "expected_checksums": {"x": "0"}}, 400,
                 "expected_checksums")]:
            r = client.post("/load_lora_adapter_from_tensors", json={**body, **fields},
                            headers=ADMIN)
            assert r.status_code == status and message in r.text, (fields, r.text)
    bad_text, bad_lease = lend_named_tensors(
        [*named, ("base_model.model.lm_head.lora_A.weight", named[0][1])])
    with bad_lease:
        r = client.post("/load_lora_adapter_from_tensors", headers=ADMIN,
                        json={**body, "lora_name": "u", "serialized_tensors": bad_text})
    assert r.status_code == 400 and "lm_head" in r.json()["message"]
    assert set(engine.get_server_info()["loaded_adapters"]) == {"t", "t2"}


def test_abort_request_ends_a_lora_generate_call(served: tuple[Any, TestClient],
                                                 adapters: dict[str, str], vocab: int) -> None:
    engine, client = served
    _ok(client.post("/load_lora_adapter", headers=ADMIN,
                    json={"lora_name": "a", "lora_path": adapters["all8"]}))
    box: dict[str, Any] = {}
    call = threading.Thread(target=lambda: box.update(r=client.post("/generate", json={
        "input_ids": prompts(vocab, [8], seed=2)[0], "lora_path": "a", "rid": "lora-call",
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}})))
    call.start()
    deadline = time.monotonic() + 30
    while engine.get_server_info()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the LoRA request never ran"
        time.sleep(0.01)
    assert _ok(client.post("/abort_request", json={"rid": "lora-call"}))["success"]
    call.join(30)
    assert not call.is_alive(), "the aborted LoRA call is still waiting"
    out = _ok(box["r"])
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 1500
    _ok(client.post("/unload_lora_adapter", json={"lora_name": "a"}, headers=ADMIN))


def test_a_directory_load_of_a_loaded_name_reloads_it_in_place(
        served: tuple[Any, TestClient], adapters: dict[str, str], vocab: int) -> None:
    """prime-rl's step: ``/load_lora_adapter`` with one fixed name and each step's directory
    (its vLLM server forces load_inplace): the name serves the newest weights, with no stale
    prefix; ``upsert: false`` keeps SGLang's refusal."""
    engine, client = served
    prompt = prompts(vocab, [11], seed=2)[0]
    step: dict[str, list[int]] = {}
    for directory in (adapters["all8"], adapters["linear4"], adapters["all8"]):
        _ok(client.post("/load_lora_adapter", headers=ADMIN,
                        json={"lora_name": "policy", "lora_path": directory}))
        served_now = _generate(client, prompt, lora_path="policy")["output_ids"]
        step.setdefault(directory, served_now)
        assert served_now == step[directory]
    assert step[adapters["all8"]] != step[adapters["linear4"]]
    _ok(client.post("/load_lora_adapter", headers=ADMIN,
                    json={"lora_name": "fresh", "lora_path": adapters["linear4"]}))
    assert _generate(client, prompt, lora_path="fresh")["output_ids"] == step[adapters["linear4"]]
    refused = client.post("/load_lora_adapter", headers=ADMIN, json={
        "lora_name": "policy", "lora_path": adapters["linear4"], "upsert": False})
    assert refused.status_code == 400 and "already loaded" in refused.text
    assert _generate(client, prompt, lora_path="policy")["output_ids"] == step[adapters["all8"]]
