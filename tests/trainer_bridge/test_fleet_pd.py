"""RolloutFleet over a prefill-decode pair: pause, sleep and relabel reach the prefill server
first, wake and continue the decode server first; a refit under load (pair requests in
flight, paused with abort, refitted, continued) leaves no request on mixed weights and the
pair answering as a fresh engine on the new weights."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.rollout_engine.disaggregation.pairs import (
    pair_generate,
    perturbed_checkpoint,
    segments,
    wait_until,
)
from tests.rollout_engine.engines import thread_engine
from trainer_bridge import RolloutFleet

TIMEOUT_S = 30.0
GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away",
           "The capital of France is", "One, two, three, four"]


@pytest.fixture(scope="module")
def prefill(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512, disaggregation_mode="prefill",
                             disaggregation_bootstrap_port=0)


@pytest.fixture(scope="module")
def decode(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, context_length=512, disaggregation_mode="decode")


class Recorded:
    """An engine whose control calls are logged as (name, "start" | "end", method)."""

    def __init__(self, name: str, engine: Any, log: list[tuple[str, str, str]],
                 lock: threading.Lock) -> None:
        self.name, self.engine, self.log, self.lock = name, engine, log, lock

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.engine, method)
        if method in ("get_server_info", "get_weight_version"):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.log.append((self.name, "start", method))
            try:
                return target(*args, **kwargs)
            finally:
                with self.lock:
                    self.log.append((self.name, "end", method))
        return call


def _sequence(log: list[tuple[str, str, str]], method: str) -> list[str]:
    return [f"{name} {edge}" for name, edge, m in log if m == method]


def test_the_pair_is_paused_and_put_to_sleep_prefill_first_and_woken_decode_first(
        prefill: Any, decode: Any) -> None:
    log: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    # listed decode first: the order comes from each server's role, not the list
    engines = [Recorded("decode", decode, log, lock), Recorded("prefill", prefill, log, lock)]
    down = ["prefill start", "prefill end", "decode start", "decode end"]
    up = ["decode start", "decode end", "prefill start", "prefill end"]
    with RolloutFleet(engines, timeout_s=TIMEOUT_S) as fleet:
        assert fleet.pause("abort").ok
        assert fleet.sleep(["kv_cache"]).ok
        assert fleet.wake(["kv_cache"]).ok
        assert fleet.update_weight_version("relabelled").ok
        assert fleet.continue_generation().ok
        assert fleet.weight_versions().versions == {0: "relabelled", 1: "relabelled"}
    assert _sequence(log, "pause_generation") == down
    assert _sequence(log, "release_memory_occupation") == down
    assert _sequence(log, "update_weight_version") == down
    assert _sequence(log, "resume_memory_occupation") == up
    assert _sequence(log, "continue_generation") == up
    # both relabelled: their weight tags agree, so the pair serves
    _, out = pair_generate(prefill, decode, PROMPTS[0], GREEDY, 8100)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_version"] == "relabelled"


def _one_version(out: dict[str, Any]) -> bool:
    spans = out["meta_info"]["weight_versions"]
    return len(spans) == 1 and spans[0]["version"] == out["meta_info"]["weight_version"]


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_a_refit_under_load_mixes_no_weights(prefill: Any, decode: Any, qwen2_path: str,
                                             tmp_path: Path, transport: str) -> None:
    from rollout_engine import Engine

    for engine in (prefill, decode):   # as a failed test before may have left them
        engine.continue_generation()
    trained = perturbed_checkpoint(qwen2_path, tmp_path / "trained")
    new_weights = load_file(str(Path(trained) / "model.safetensors"))
    long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    outs: dict[int, Any] = {}

    def pair_request(room: int) -> None:
        outs[room] = pair_generate(prefill, decode, PROMPTS[room % len(PROMPTS)], long,
                                   room)[1]

    def start(rooms: range) -> list[threading.Thread]:
        threads = [threading.Thread(target=pair_request, args=(room,), daemon=True)
                   for room in rooms]
        for t in threads:
            t.start()
        return threads

    before_refit = start(range(8200, 8208))
    wait_until("pair requests decoding", lambda: decode.get_server_info()[
        "num_running_reqs"] == 8)
    fleet = RolloutFleet([prefill, decode], transport=transport, timeout_s=TIMEOUT_S)
    try:
        assert fleet.pause("abort").ok
        during_pause = start(range(8300, 8304))   # wait for the continue
        assert fleet.refit(new_weights, version="step-1").ok
        assert fleet.continue_generation().ok
        for t in before_refit + during_pause:
            t.join(60)
    finally:
        fleet.close()

    assert len(outs) == 12
    for room, out in outs.items():
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] == "abort":
            continue
        assert _one_version(out), (room, out["meta_info"]["weight_versions"])
    aborted = [r for r, o in outs.items() if o["meta_info"]["finish_reason"]["type"] == "abort"]
    assert set(range(8200, 8208)) <= set(aborted)   # in flight at the pause
    for room in range(8300, 8304):                 # sent while paused: all on the new weights
        assert outs[room]["meta_info"]["weight_versions"] == [
            {"version": "step-1", "start": 0, "end": 400}]

    fresh = Engine(model_path=trained, scheduler_mode="thread", dtype="float32", device="cpu",
                   context_length=512)
    try:
        for i, prompt in enumerate(PROMPTS):
            ref = fresh.generate(prompt, GREEDY, return_logprob=True)
            _, out = pair_generate(prefill, decode, prompt, GREEDY, 8400 + i,
                                   return_logprob=True)
            assert out["output_ids"] == ref["output_ids"]
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    finally:
        fresh.shutdown()
    for engine in (prefill, decode):
        assert engine.check_integrity()["idle"] is True
        assert engine.get_weight_version() == "step-1"
    wait_until("every prefill KV segment released", lambda: not segments())
    assert prefill.get_server_info()["disaggregation"]["held"] == 0


def test_phases_put_prefill_servers_first_going_down_and_last_coming_up(
        prefill: Any) -> None:
    from trainer_bridge.pd_order import DOWN, UP, phases

    roles = {0: "decode", 1: "prefill", 2: "null", 3: "prefill"}
    assert phases(roles, DOWN) == [[1, 3], [0, 2]]
    assert phases(roles, UP) == [[0, 2], [1, 3]]
    assert phases({0: "null"}, DOWN) == [[0]]
    with pytest.raises(ValueError, match="direction"):
        phases(roles, "sideways")
    with RolloutFleet([prefill], timeout_s=TIMEOUT_S) as fleet, \
            pytest.raises(ValueError, match="new_version"):
        fleet.update_weight_version("")
