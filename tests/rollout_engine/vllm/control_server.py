"""A live uvicorn server over a thread-scheduler engine on W1 (and the W2 checkpoint a refit
loads), for the vLLM control-route tests; streaming requests started in threads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 44))]
LONG = 300


def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


def served(model_path: str) -> Iterator[tuple[str, Any]]:
    """(url, engine): a float32 thread-scheduler engine served by uvicorn."""
    from rollout_engine import Engine
    from tests.rollout_engine.engines import served_over_http

    engine = Engine(model_path=model_path, scheduler_mode="thread", dtype="float32",
                    device="cpu", context_length=1024)
    try:
        for url in served_over_http(engine):
            yield url, engine
    finally:
        engine.shutdown()


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def stream_generate(url: str, input_ids: list[int], rid: str, n: int = LONG
                    ) -> tuple[threading.Thread, dict[str, Any]]:
    """A streaming ``/generate`` in a thread; ``box["final"]`` is its last chunk."""
    box: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream(
                "POST", "/generate", json={"input_ids": input_ids, "rid": rid, "stream": True,
                                           "sampling_params": greedy(n)}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    box["final"] = json.loads(line[6:])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def wait_until(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def wait_running(engine: Any, n: int) -> None:
    """Until ``n`` requests decode (each has sampled a token)."""
    wait_until(lambda: engine.get_server_info()["num_running_reqs"] >= n, f"{n} run")


def tokens_so_far(engine: Any, rid: str) -> int:
    """Output tokens the frontend has received for ``rid``: after a pause answer, every token
    sampled before it (outputs and answers travel in one ordered channel)."""
    return len(engine.tm.states[rid].output_ids)
