"""A server with --dp-size 2 as the frameworks see it from outside:

    slime   slime/backends/sglang_utils/external.py discover_external_engines: num_gpus =
            server_info num_gpus (or num_gpus_per_engine, or tp_size * pp_size); the
            weight-update group then spans sum(num_gpus) + 1 ranks, engine i from rank
            1 + the GPUs before it (update_weight_from_distributed.py
            connect_rollout_engines_from_distributed)
    miles   miles/backends/sglang_utils/sglang_engine.py _init_external: every field it would
            have started the engine with, less _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS, must equal
            /get_server_info's (gpu_id_step 1, dp_size, tp_size, ...); check_weights over both
            replicas, flattened by miles/utils/audit_utils/checksum_utils.py
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from rollout_engine.compat.server_args import SGLANG_FLAGS
from rollout_engine.protocol.tensor_payload import serialize_named_tensors
from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.compat.test_miles_weight_update import miles_engine_checksums
from tests.rollout_engine.compat.test_slime_distributed import init_process_group
from tests.rollout_engine.engines import app_client, thread_engine

MILES_SKIP_CHECK = {"model_path", "trust_remote_code", "random_seed", "nccl_port",
                    "dist_init_addr", "skip_server_warmup", "enable_draft_weights_cpu_backup",
                    "enable_metrics", "mem_fraction_static"}


@pytest.fixture(scope="module")
def w1() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2"))


@pytest.fixture(scope="module")
def dp2(w1: str) -> Iterator[Any]:
    yield from thread_engine(w1, dp_size=2, enable_memory_saver=True,
                             weight_update_group_timeout=60)


@pytest.fixture(scope="module")
def client(dp2: Any) -> Iterator[TestClient]:
    yield from app_client(dp2)


def test_server_info_reports_every_arg_and_the_gpus(client: TestClient, dp2: Any) -> None:
    info = client.get("/get_server_info").json()
    assert set(SGLANG_FLAGS) <= set(info)
    assert info["num_gpus"] == 2 and info["gpu_id_step"] == 1
    assert client.get("/server_info").json()["num_gpus"] == 2
    # miles' _compute_server_args for an external engine of one GPU per engine, dp 2
    expected = {"model_path": dp2.config.model_path, "trust_remote_code": True,
                "random_seed": 1234, "enable_memory_saver": True, "host": "127.0.0.1",
                "port": dp2.config.port, "nccl_port": None, "nnodes": 1, "node_rank": 0,
                "dist_init_addr": f"127.0.0.1:{dp2.config.port}", "gpu_id_step": 1,
                "base_gpu_id": 0, "tp_size": 1, "dp_size": 2, "pp_size": 1, "ep_size": 1,
                "skip_server_warmup": True, "enable_draft_weights_cpu_backup": True,
                "enable_metrics": True}
    for name in (k for k in expected if k not in MILES_SKIP_CHECK):
        assert info.get(name) == expected[name], name
    # slime's discover_external_engines
    pp_size = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)
    tp_size = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
    num_gpus = int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp_size * pp_size)
    assert num_gpus == 2


def test_slimes_group_from_num_gpus_spans_both_replicas(client: TestClient) -> None:
    """slime sizes the group from num_gpus: rank 0 and one rank per replica must meet."""
    info = client.get("/get_server_info").json()
    engine_gpu_counts = [int(info.get("num_gpus") or info["tp_size"] * info["pp_size"])]
    world_size = sum(engine_gpu_counts) + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=client.post(
        "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": world_size, "group_name": "slime-pp_0", "backend": "gloo"})))
    t.start()
    group = init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0,
                               "slime-pp_0", datetime.timedelta(seconds=30))
    t.join(60)
    try:
        assert box["r"].status_code == 200, box["r"].text
        assert group.size() == 3
    finally:
        r = client.post("/destroy_weights_update_group", json={"group_name": "slime-pp_0"})
        torch.distributed.destroy_process_group(group)
    assert r.status_code == 200, r.text


def test_weights_checker_over_both_replicas(client: TestClient, w1: str) -> None:
    def check(action: str) -> Any:
        return client.post("/weights_checker", json={
            "action": action, "allow_quant_error": False, "selector": "all"})

    body = check("checksum").json()
    infos = [r["parallelism_info"][0] for r in body["ranks"]]
    assert [(i["dp_rank"], i["rank"], i["dp_size"], i["size"]) for i in infos] == [
        (0, 0, 2, 2), (1, 1, 2, 2)]
    before = miles_engine_checksums(body)
    names = {k.split("/", 1)[1] for k in before}
    assert all(before[f"rank0/{n}"] == before[f"rank1/{n}"] for n in names)
    assert check("snapshot").status_code == 200
    assert check("reset_tensors").status_code == 200
    r = check("compare")
    assert r.status_code == 400 and r.json()["message"].startswith("dp rank 0: ")
    named = sorted(iter_safetensors(w1))
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(named)], "flush_cache": False})
    assert r.status_code == 200, r.text
    r = check("compare")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert miles_engine_checksums(check("checksum").json()) == before
