"""--dp-size 2: two scheduler replicas behind one frontend answer every request once and like
one scheduler (greedy), keep a GRPO group on one replica (the cache_aware dispatcher sends
the group's next round back to the replica holding its prefix: ``cached_tokens``), fan
control calls out (refit by every transport, sleep / wake, pause, flush, loads) and report
per replica; a replica that dies takes the engine down with an error naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rollout_engine.dp.dispatch import Load
from tests.rollout_engine.engines import app_client, thread_engine

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
PROMPTS = [[1 + i, 7 * i % 50 + 2, 3, 40 + i, 9] for i in range(8)]
GROUP_PROMPT = list(range(100, 148))    # 48 tokens: 3 dispatcher blocks
FLAGS = {"max_total_tokens": 1024}


@pytest.fixture(scope="module")
def dp1(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, **FLAGS)


@pytest.fixture(scope="module")
def dp2(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, dp_size=2, load_balance_method="round_robin",
                             **FLAGS)


@pytest.fixture(scope="module")
def dp2_cache_aware(qwen2_path: str) -> Iterator[Any]:
    yield from thread_engine(qwen2_path, dp_size=2, load_balance_method="cache_aware", **FLAGS)


def _greedy(engine: Any) -> list[tuple[str, list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True,
                           rid=[f"p{i}" for i in range(len(PROMPTS))])
    return [(o["meta_info"]["id"], o["output_ids"],
             [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _per_replica(engine: Any, key: str) -> list[int]:
    """A scheduler counter of each replica (get_server_info's dp_results)."""
    return [r["stats"][key] for r in engine.get_server_info()["dp_results"]]


def _same(rows: list[Any], want: list[Any]) -> None:
    assert [(rid, ids) for rid, ids, _ in rows] == [(rid, ids) for rid, ids, _ in want]
    for (_, _, lps), (_, _, want_lps) in zip(rows, want):
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) <= 1e-4


def test_every_request_is_answered_once_like_one_scheduler(dp1, dp2):
    before = _per_replica(dp2, "prompt_tokens")
    rows = _greedy(dp2)
    _same(rows, _greedy(dp1))
    assert sorted(rid for rid, _, _ in rows) == sorted(f"p{i}" for i in range(8))
    grew = [a - b for a, b in zip(_per_replica(dp2, "prompt_tokens"), before)]
    # round robin: each replica computed half of the prompts, none twice
    assert grew == [sum(len(p) for p in PROMPTS[0::2]), sum(len(p) for p in PROMPTS[1::2])]
    assert dp2.tm.host.dp_chan.load_snapshot() == [Load(), Load()]   # nothing left in flight


def _group(engine: Any, seed: int) -> list[dict[str, Any]]:
    return engine.generate(input_ids=GROUP_PROMPT, sampling_params={
        "max_new_tokens": 4, "temperature": 1.0, "n": 4, "sampling_seed": seed})


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_a_grpo_group_stays_on_one_replica(policy, dp2, dp2_cache_aware):
    engine = dp2_cache_aware if policy == "cache_aware" else dp2
    engine.flush_cache()
    before = _per_replica(engine, "prompt_tokens")
    first = _group(engine, seed=1)
    grew = [a - b for a, b in zip(_per_replica(engine, "prompt_tokens"), before)]
    assert sorted(grew) == [0, 4 * len(GROUP_PROMPT)]      # the whole group on one replica
    second = _group(engine, seed=2)
    assert len(first) == len(second) == 4
    cached = [o["meta_info"]["cached_tokens"] for o in second]
    if policy == "cache_aware":   # back to the replica holding the prefix: every sample hits
        assert min(cached) >= len(GROUP_PROMPT) - 1
    else:                         # the other replica computes the prompt once afresh
        assert min(cached) == 0


def test_loads_and_server_info_report_each_replica(dp2):
    dp2.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)   # one to each replica
    info = dp2.get_server_info()
    assert info["dp_size"] == 2 and len(info["internal_states"]) == 2
    assert len(info["dp_results"]) == 2
    for key in ("prompt_tokens", "decode_tokens", "forward_passes"):   # /metrics reads these
        assert info["stats"][key] == sum(r["stats"][key] for r in info["dp_results"])
    assert info["stats"]["prompt_tokens"] > info["dp_results"][0]["stats"]["prompt_tokens"]
    for client in app_client(dp2):
        loads = client.get("/get_load").json()
        assert [x["dp_rank"] for x in loads] == [0, 1]
        v1 = client.get("/v1/loads?include=core").json()
        assert v1["dp_rank_count"] == 2 and [x["dp_rank"] for x in v1["loads"]] == [0, 1]
        assert client.get("/get_weight_version").json()["weight_version"] == "default"
        assert client.post("/flush_cache").status_code == 200


def test_bad_flags_name_the_field(qwen2_path):
    from rollout_engine.config import EngineConfig

    with pytest.raises(ValueError, match="dp_size"):
        EngineConfig(model_path=qwen2_path, dp_size=0)
    with pytest.raises(ValueError, match="load_balance_method"):
        EngineConfig(model_path=qwen2_path, load_balance_method="follow_bootstrap_room")
    flags = EngineConfig.from_kwargs(model_path=qwen2_path, dp_size=2,
                                     load_balance_method="total_requests")
    assert (flags.dp_size, flags.load_balance_method) == (2, "total_requests")
