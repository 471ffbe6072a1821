"""Every route of the app is either on the short public list below or refuses a caller without
the admin key (401) before its handler runs. Routes are enumerated from ``app.routes``, so a
route added later is guarded unless it is put on the list on purpose."""

from __future__ import annotations

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from rollout_engine.entrypoints.http_server import create_app
from tests.rollout_engine.entrypoints.conftest import LiveServer

# routes a user (no admin key) may call: generation, health, read-only information
PUBLIC = {
    "/generate", "/health", "/health_generate", "/get_model_info", "/model_info",
    "/get_server_info", "/server_info", "/get_weight_version", "/metrics", "/get_load",
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/loads",
    "/abort_request",  # a user may abort a rid; abort_all needs the admin key (below)
    # vLLM's data routes: generation and the tokenizer
    "/inference/v1/generate", "/tokenize", "/detokenize",
    "/inference/v1/abort_requests",   # named request ids only, as /abort_request's rid
    "/is_paused", "/is_sleeping",     # vLLM's read-only state
}


def _routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            out.extend((m, route.path) for m in sorted(route.methods - {"HEAD", "OPTIONS"}))
    return out


def test_every_control_route_needs_the_admin_key(live_server: LiveServer) -> None:
    app = create_app(live_server.engine, admin_api_key="admin-key")
    routes = _routes(app)
    guarded = [(m, p) for m, p in routes if p not in PUBLIC]
    # the control surface we know of must be among them (the enumeration is not vacuous)
    must = {"/flush_cache", "/check_integrity", "/release_memory_occupation",
            "/resume_memory_occupation", "/update_weights_from_disk",
            "/update_weights_from_tensor", "/init_weights_update_group",
            "/update_weights_from_distributed", "/destroy_weights_update_group",
            "/update_weight_version", "/pause_generation", "/continue_generation",
            "/get_weights_by_name"}
    assert must <= {p for _, p in guarded}
    with TestClient(app) as c:
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                assert "key" in r.json()["error"]["message"]
        r = c.post("/abort_request", json={"abort_all": True})
        assert r.status_code == 401
    live_server.assert_no_leak()
