"""The frontend's metrics: one registry per app, the names, types and buckets scrapers rely on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from rollout_engine.entrypoints.metrics import E2E_BUCKETS, Metrics

INFO = {"max_total_num_tokens": 100, "kv_free_tokens": 25, "num_running_reqs": 2,
        "num_waiting_reqs": 1, "kv_cached_tokens": 10, "weight_version": 'v"1',
        "stats": {"prompt_tokens": 8, "cached_tokens": 2, "forward_passes": 5}}


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_two_apps_count_apart() -> None:
    a, b = Metrics(), Metrics()
    a.observe_finished({"finish_reason": {"type": "stop"}, "prompt_tokens": 3,
                        "completion_tokens": 4, "e2e_latency": 0.2})
    a.observe_disconnect()
    fa, fb = _families(a.render(None, alive=True)), _families(b.render(None, alive=True))
    assert fa["rollout_engine_generation_tokens"].samples[0].value == 4
    assert fb["rollout_engine_generation_tokens"].samples[0].value == 0
    assert fa["rollout_engine_client_disconnects"].samples[0].value == 1
    assert fb["rollout_engine_client_disconnects"].samples[0].value == 0


def test_names_types_labels_and_buckets() -> None:
    m = Metrics()
    m.observe_finished({"finish_reason": {"type": "length"}, "e2e_latency": 0.3})
    m.observe_first_token(0.02)
    text = m.render(INFO, alive=True)
    families = _families(text)
    types = {name: f.type for name, f in families.items()}
    for name, kind in (("scheduler_alive", "gauge"), ("num_running_reqs", "gauge"),
                       ("num_waiting_reqs", "gauge"), ("kv_total_tokens", "gauge"),
                       ("kv_cached_tokens", "gauge"), ("kv_usage_ratio", "gauge"),
                       ("cache_hit_rate", "gauge"), ("num_retractions", "counter"),
                       ("forward_passes", "counter"), ("weight_version_info", "gauge"),
                       ("prompt_tokens", "counter"), ("generation_tokens", "counter"),
                       ("cached_prompt_tokens", "counter"), ("requests", "counter"),
                       ("client_disconnects", "counter"),
                       ("e2e_request_latency_seconds", "histogram"),
                       ("time_to_first_token_seconds", "histogram")):
        assert types[f"rollout_engine_{name}"] == kind, name
    assert families["rollout_engine_kv_usage_ratio"].samples[0].value == 0.75
    assert families["rollout_engine_cache_hit_rate"].samples[0].value == 0.25
    version = families["rollout_engine_weight_version_info"].samples[0]
    assert version.labels == {"version": 'v"1'} and version.value == 1
    reasons = {s.labels["finish_reason"]: s.value
               for s in families["rollout_engine_requests"].samples if s.name.endswith("_total")}
    assert reasons == {"stop": 0, "length": 1, "abort": 0}
    buckets = [s.labels["le"] for s in families["rollout_engine_e2e_request_latency_seconds"].samples
               if s.name.endswith("_bucket")]
    assert buckets == [repr(b) for b in E2E_BUCKETS] + ["+Inf"]
    assert "# TYPE rollout_engine_e2e_request_latency_seconds histogram" in text


def test_scheduler_families_only_while_reachable() -> None:
    families = _families(Metrics().render(None, alive=False))
    assert families["rollout_engine_scheduler_alive"].samples[0].value == 0
    assert "rollout_engine_num_running_reqs" not in families
