"""/get_server_info, /get_model_info, /get_load and /v1/loads in SGLang's shapes, read the way
the frameworks and the router read them:

    slime   slime/backends/sglang_utils/sglang_engine.py   _init_external: every started-with
            field (enable_memory_saver, ...) must equal /server_info's
            slime/backends/sglang_utils/external.py        tp_size / pp_size / num_gpus
            slime/backends/sglang_utils/server_control.py   abort_server_until_idle: abort_all,
            then /v1/loads?include=core until num_requests_from_load(...) == 0
    router  sgl-router/src/core/workflow/steps/worker_registration.rs   ServerInfo (serde types)
            sgl-router/src/core/worker_manager.rs   get_worker_load: sum of /get_load num_tokens
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_engine.compat.server_args import SGLANG_FLAGS, SGLANG_VERSIONS
from rollout_engine.control.introspection import ThroughputMeter
from rollout_engine.entrypoints.engine import rollout_engine_version
from tests.rollout_engine.compat.test_server_args import slime_kwargs
from tests.rollout_engine.engines import served_over_http

# slime's _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS (sglang_engine.py)
SLIME_SKIP_CHECK = {
    "model_path", "trust_remote_code", "random_seed", "host", "port", "nccl_port", "nnodes",
    "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "tp_size", "dp_size", "pp_size",
    "ep_size", "skip_server_warmup", "enable_draft_weights_cpu_backup", "enable_metrics",
    "mem_fraction_static"}


def slime_num_requests_from_load(load: Any) -> int:
    """slime's server_control.num_requests_from_load, verbatim in behaviour."""
    if isinstance(load, list):
        return sum(slime_num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        value = load.get(key)
        if isinstance(value, int):
            return value
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0)


def router_parses_server_info(info: dict[str, Any]) -> None:
    """sgl-router's ``ServerInfo`` (serde): these keys, when present, must have these types, or
    the worker's registration fails."""
    optional_usize = ("dp_size", "max_batch_size", "max_total_tokens", "max_prefill_tokens",
                      "max_running_requests", "max_num_reqs")
    for key in optional_usize:
        value = info.get(key)
        assert value is None or isinstance(value, int) and not isinstance(value, bool) \
            and value >= 0, (key, value)
    for key in ("model_id", "model", "model_path", "version"):
        assert info.get(key) is None or isinstance(info[key], str), key
    assert info["dp_size"] == 1 and info["model_path"]


# -- the Python Engine ------------------------------------------------------------------------
def test_server_info_carries_sglangs_fields(make_engine: Any, qwen2_path: str) -> None:
    started_with = {**slime_kwargs(qwen2_path), "random_seed": 7}
    engine = make_engine(**started_with)
    info = engine.get_server_info()
    json.dumps(info)
    # slime's external-engine check: the fields it started SGLang with, less its skip list
    # (computed before it adds cuda_graph_backend_prefill), read back equal
    checked = [k for k in started_with if k not in SLIME_SKIP_CHECK
               and k != "cuda_graph_backend_prefill"]
    assert checked == ["enable_memory_saver"]
    for name in checked:
        assert info[name] == started_with[name], name
    # slime's external.py: the topology it infers
    assert int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1) == 1
    router_parses_server_info(info)
    # SGLang's fields, under its names
    assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
    assert (info["nnodes"], info["node_rank"], info["disaggregation_mode"]) == (1, 0, "null")
    assert info["enable_memory_saver"] is True and info["random_seed"] == 7
    # every ServerArgs field is reported: an ignored flag as given, else at SGLang's default
    assert set(SGLANG_FLAGS) <= set(info)
    assert info["trust_remote_code"] is True and info["skip_server_warmup"] is True
    assert info["dist_init_addr"] == "127.0.0.1:15002" and info["nccl_port"] == 15001
    assert info["gpu_id_step"] == 1 and info["decode_log_interval"] == 40
    assert info["num_gpus"] == 1 and "ignored_sglang_args" not in info
    assert info["mem_fraction_static"] == 0.8 and info["page_size"] == 1
    assert info["chunked_prefill_size"] == 2048 and info["schedule_policy"] == "lpm"
    assert info["disable_radix_cache"] is False and info["served_model_name"] is None
    assert info["status"] == "ready" and info["max_total_num_tokens"] > 0
    assert info["max_req_input_len"] == min(info["context_length"],
                                            info["max_total_num_tokens"]) - 1
    assert info["max_running_requests"] == engine.tm.server_info["max_running_requests"]
    assert info["version"] == rollout_engine_version() and info["version"] != "0+unknown"
    assert info["sglang_compatible_versions"] == list(SGLANG_VERSIONS)
    (state,) = info["internal_states"]
    assert state["tp_size"] == 1 and state["enable_memory_saver"] is True
    assert isinstance(state["last_gen_throughput"], float)
    assert set(state["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
    assert state["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
    assert state["effective_max_running_requests_per_dp"] == info["max_running_requests"]
    # ours, as before
    for key in ("num_running_reqs", "num_waiting_reqs", "stats", "released_memory",
                "weights_stale", "weight_version", "kv_free_tokens", "scheduler_mode"):
        assert key in info, key


def test_defaults_and_dtype_read_back_as_given(make_engine: Any, qwen2_path: str) -> None:
    info = make_engine(qwen2_path, dtype="float16").get_server_info()
    assert info["enable_memory_saver"] is False     # SGLang's default; slime compares it
    assert info["dtype"] == "float16"               # slime checks it too when it runs fp16


def test_throughput_meter_windows() -> None:
    meter = ThroughputMeter(window_s=1.0)
    t0 = meter.since
    assert meter.sample(10, t0 + 0.5) == 0.0         # the window is not over yet
    assert meter.sample(10, t0 + 1.0) == 10.0
    assert meter.sample(30, t0 + 1.5) == 10.0        # kept until the next window closes
    assert meter.sample(30, t0 + 3.0) == 10.0        # (30 - 10) / 2 s
    assert meter.sample(30, t0 + 4.0) == 0.0         # idle


def test_model_info_fields(make_engine: Any, qwen2_path: str) -> None:
    info = make_engine(qwen2_path, weight_version="w7").get_model_info()
    assert info["model_path"] == info["tokenizer_path"] == qwen2_path
    assert info["is_generation"] is True and info["weight_version"] == "w7"
    assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]
    assert info["has_image_understanding"] is False and info["preferred_sampling_params"] is None


# -- over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_paths: dict[str, str]) -> Iterator[tuple[str, Any]]:
    from rollout_engine import Engine

    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    scheduler_mode="thread", context_length=512, enable_memory_saver=True)
    try:
        for url in served_over_http(engine):
            yield url, engine
    finally:
        engine.shutdown()


CORE_V1_KEYS = {  # 0.5.23's LoadSnapshot core keys + 0.5.9's num_total_reqs
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
    "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens", "num_active_tokens",
    "num_prealloc_ready_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
    "gen_throughput", "cache_hit_rate", "utilization", "total_prefill_uncached_tokens",
    "total_prefill_busy_us", "decode_moments", "num_total_reqs"}


def test_info_routes(server: tuple[str, Any]) -> None:
    url, engine = server
    a = httpx.get(url + "/get_server_info", timeout=30).json()
    b = httpx.get(url + "/server_info", timeout=30).json()
    assert set(a) == set(b) and a["enable_memory_saver"] is True and a["tp_size"] == 1
    router_parses_server_info(a)
    assert a["api_key"] is None and a["version"] == rollout_engine_version()
    model = httpx.get(url + "/get_model_info", timeout=30).json()
    assert model == httpx.get(url + "/model_info", timeout=30).json()
    assert model["model_type"] == "qwen2" and model["weight_version"] == "default"


def test_load_routes_idle(server: tuple[str, Any]) -> None:
    url, engine = server
    (entry,) = httpx.get(url + "/get_load", timeout=30).json()
    assert set(entry) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                          "num_pending_tokens", "ts_tic"}
    assert (entry["dp_rank"], entry["num_reqs"], entry["num_tokens"]) == (0, 0, 0)
    body = httpx.get(url + "/v1/loads", timeout=30).json()
    assert {"timestamp", "version", "dp_rank_count", "accelerator", "num_accelerators",
            "loads", "aggregate"} <= set(body)
    assert body["dp_rank_count"] == 1 and body["accelerator"] is None
    (load,) = body["loads"]
    assert CORE_V1_KEYS <= set(load) and {"memory", "disaggregation", "queues"} <= set(load)
    assert load["max_total_num_tokens"] == engine.get_server_info()["max_total_num_tokens"]
    assert load["memory"]["token_capacity"] == load["max_total_num_tokens"]
    assert body["aggregate"]["total_reqs"] == 0 and slime_num_requests_from_load(body) == 0
    core = httpx.get(url + "/v1/loads?include=core", timeout=30).json()["loads"][0]
    assert set(core) == CORE_V1_KEYS
    queues = httpx.get(url + "/v1/loads?include=core,queues", timeout=30).json()["loads"][0]
    assert set(queues) == CORE_V1_KEYS | {"queues"}
    assert httpx.get(url + "/v1/loads?dp_rank=1", timeout=30).json()["loads"] == []
    bad = httpx.get(url + "/v1/loads?include=core,bogus", timeout=30)
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    assert httpx.get(url + "/v1/loads?dp_rank=x", timeout=30).status_code == 400
    text = httpx.get(url + "/v1/loads?format=prometheus", timeout=30).text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
    assert 'sglang_memory_token_capacity{dp_rank="0"}' in text


def test_loads_while_generating_and_slimes_abort_until_idle(server: tuple[str, Any]) -> None:
    url, engine = server
    started = threading.Event()
    chunks: list[dict[str, Any]] = []

    def stream() -> None:
        body = {"text": "keep going", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(60)
        (entry,) = httpx.get(url + "/get_load", timeout=30).json()
        assert entry["num_reqs"] == 1 and entry["num_tokens"] > 0
        load = httpx.get(url + "/v1/loads?include=core", timeout=30).json()
        assert slime_num_requests_from_load(load) == 1
        assert load["loads"][0]["num_used_tokens"] > 0 and load["loads"][0]["token_usage"] > 0
        # slime's abort_server_until_idle: abort everything, then the count reads 0
        r = httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
        assert r.status_code == 200
        load = httpx.get(url + "/v1/loads?include=core", timeout=30).json()
        assert slime_num_requests_from_load(load) == 0
    finally:
        thread.join(120)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
