"""Control-route bodies coerced as SGLang's pydantic request models coerce them (lax mode):
numbers and booleans sent as strings are taken, what SGLang would refuse is a 400 naming the
field, and every route's fields have a declared type to coerce to (one place: the handlers'
signatures, read by ``control/call_types.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from rollout_engine.control.call_types import coerce_call, declared_types
from rollout_engine.entrypoints.rl_routes import BASE_REQ, CONTROL_ROUTES

NAME = "model.norm.weight"


def test_every_route_field_has_a_declared_type() -> None:
    for route in CONTROL_ROUTES:
        types = declared_types(route.method)
        untyped = sorted(set(route.fields) - set(BASE_REQ) - set(types))
        assert not untyped, f"{route.path}: no declared type for {untyped}"


@pytest.mark.parametrize("method,given,want", [
    ("init_weights_update_group", {"master_port": "29500", "rank_offset": " 1 ",
                                   "world_size": 3.0}, {"master_port": 29500, "rank_offset": 1,
                                                        "world_size": 3}),
    ("update_weights_from_distributed", {"flush_cache": "false", "shapes": [["2", 3]],
                                         "pp_rank": "0"},
     {"flush_cache": False, "shapes": [[2, 3]], "pp_rank": 0}),
    ("update_weights_from_disk", {"abort_all_requests": "true", "token_step": "7",
                                  "keep_pause": 0, "is_async": "no"},
     {"abort_all_requests": True, "token_step": 7, "keep_pause": False, "is_async": False}),
    ("weights_checker", {"allow_quant_error": "1", "skip_tensor_list": ("a", "b")},
     {"allow_quant_error": True, "skip_tensor_list": ["a", "b"]}),
])
def test_coercions_sglang_makes(method: str, given: dict[str, Any],
                                want: dict[str, Any]) -> None:
    assert coerce_call(method, given) == want


@pytest.mark.parametrize("method,given,field", [
    ("init_weights_update_group", {"master_port": "abc"}, "master_port"),
    ("init_weights_update_group", {"rank_offset": 1.5}, "rank_offset"),
    ("init_weights_update_group", {"master_address": 5}, "master_address"),
    ("update_weights_from_distributed", {"flush_cache": "maybe"}, "flush_cache"),
    ("update_weights_from_distributed", {"shapes": [["2", "x"]]}, "shapes"),
    ("update_weights_from_disk", {"manifest": "x"}, "manifest"),
    ("release_memory_occupation", {"tags": ["weights", 3]}, "tags"),
])
def test_what_sglang_refuses_names_the_field(method: str, given: dict[str, Any],
                                             field: str) -> None:
    with pytest.raises(ValueError, match=f"^{method}: {field}: "):
        coerce_call(method, given)


def test_string_values_over_http(client: TestClient) -> None:
    r = client.post("/get_weights_by_name", json={"name": NAME, "truncate_size": "2"})
    assert r.status_code == 200, r.text
    assert len(r.json()["result"]) == 2
    r = client.get("/get_weights_by_name", params={"name": NAME, "truncate_size": "3"})
    assert r.status_code == 200 and len(r.json()["result"]) == 3
    r = client.post("/update_weight_version",
                    json={"new_version": "v-str", "abort_all_requests": "false"})
    assert r.status_code == 200, r.text
    assert client.get("/get_weight_version").json() == {"weight_version": "v-str"}
    r = client.post("/update_weight_version", json={"new_version": "default"})
    assert r.status_code == 200


@pytest.mark.parametrize("route,body,field", [
    ("/get_weights_by_name", {"name": NAME, "truncate_size": "two"}, "truncate_size"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "abc",
                                    "rank_offset": 1, "world_size": 2}, "master_port"),
    ("/pause_generation", {"mode": 5}, "mode"),
    ("/update_weights_from_disk", {"model_path": "/x", "flush_cache": "perhaps"},
     "flush_cache"),
])
def test_uncoercible_values_are_400_naming_the_field(client: TestClient, route: str,
                                                     body: dict[str, Any], field: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert f": {field}: " in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
