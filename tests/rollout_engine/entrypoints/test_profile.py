"""``/start_profile`` / ``/stop_profile`` (SGLang's torch-profiler routes): a trace of the
scheduler's steps written where the caller asks, stopped by the caller or after ``num_steps``
forward passes; bad settings are a 400 naming the field, and generation is unaffected."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.rollout_engine.engines import app_client, thread_engine

GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def client(qwen2_path: str) -> Iterator[Any]:
    for engine in thread_engine(qwen2_path, context_length=256):
        yield from app_client(engine)


def _events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_until_stopped_writes_a_trace_of_the_steps(client: Any, tmp_path: Path) -> None:
    plain = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
    r = client.post("/start_profile", json={"output_dir": str(tmp_path), "profile_id": "run1",
                                            "activities": ["CPU", "GPU"]})
    assert r.status_code == 200, r.text
    again = client.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert again.status_code == 400 and "already running" in again.json()["message"]
    traced = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
    assert traced.json()["output_ids"] == plain.json()["output_ids"]
    stop = client.post("/stop_profile")
    assert stop.status_code == 200, stop.text
    [path] = stop.json()["result"]["trace_files"]
    assert Path(path).parent == tmp_path and Path(path).name.startswith("run1-TP-0")
    ops = [e["name"] for e in _events(path) if e.get("name", "").startswith("aten::")]
    assert len(ops) > 10   # the forward's operators were recorded
    none = client.post("/stop_profile")
    assert none.status_code == 400 and "no profile is running" in none.json()["message"]


def test_num_steps_stops_by_itself(client: Any, tmp_path: Path) -> None:
    r = client.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 2})
    assert r.status_code == 200, r.text
    client.post("/generate", json={"input_ids": [8, 9], "sampling_params": GREEDY})
    files = sorted(tmp_path.glob("*.trace.json.gz"))
    assert len(files) == 1 and _events(str(files[0]))
    stop = client.post("/stop_profile")   # already stopped: says what it wrote
    assert stop.status_code == 200 and stop.json()["result"]["trace_files"] == [str(files[0])]


@pytest.mark.parametrize("body, field", [
    ({"activities": ["CPU", "TPU"]}, "activities"),
    ({"activities": ["CUDA_PROFILER"]}, "activities"),
    ({"num_steps": 0}, "num_steps"),
    ({"profile_by_stage": True}, "profile_by_stage"),
    ({"profile_id": "../x"}, "profile_id"),
    ({"trace": True}, "trace"),
])
def test_bad_settings_are_refused_by_name(client: Any, body: dict[str, Any], field: str) -> None:
    r = client.post("/start_profile", json=body)
    assert r.status_code == 400 and field in r.text
    assert client.post("/stop_profile").status_code == 400   # nothing was started
