"""--tp-size 2 against one rank, on the tiny qwen2, qwen3, llama, qwen3_moe and qwen2_moe: greedy tokens identical and
logprobs (output and prompt) within 1e-4, on first load, after a refit by each transport
(disk, tensor handles, one broadcast to both ranks: a fleet of this engine and a one-rank
one, 1 + 2 + 1 ranks) and after sleep / wake; control calls cover every rank. One TP=2 engine (two processes) per model, shared by the module's tests.
qwen2 and qwen3 split their 2 KV heads over the ranks; the llama has 1 KV head, which each
rank keeps a copy of."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import thread_engine

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
SHARED = list(range(40, 70))   # a 30-token prefix: the second call extends a radix match
PROMPTS = [[1, 2, 3], SHARED + [5, 6], [9, 30, 200, 11, 300, 17], SHARED + [7]]
FLAGS = {"max_total_tokens": 2048}


@pytest.fixture(scope="module", params=("qwen2", pytest.param("qwen3", marks=pytest.mark.slow),
                                        "llama", "qwen3_moe",
                                        pytest.param("qwen2_moe", marks=pytest.mark.slow)))
def weights(request: Any) -> tuple[str, str]:
    """The model's two weight sets (seed 0 and 1), same shapes. The MoE models split every
    expert (and Qwen2-MoE's shared expert) over the ranks; the Qwen2-MoE has a dense layer
    (with -m slow: the default suite's time, as Qwen3's, whose QK norms single-rank parity
    covers)."""
    from rollout_engine.testing.tiny_model import tiny_model_path
    from rollout_engine.testing.tiny_moe import tiny_moe_path

    if request.param.endswith("_moe"):
        shape = {"num_layers": 3, "mlp_only_layers": (1,)} if request.param == "qwen2_moe" else {}
        return (str(tiny_moe_path(request.param, **shape)),
                str(tiny_moe_path(request.param, seed=1, **shape)))
    shape = {"num_kv_heads": 1} if request.param == "llama" else {}
    return (str(tiny_model_path(request.param, **shape)),
            str(tiny_model_path(request.param, seed=1, **shape)))


def _rollouts(engine: Any) -> list[tuple[list[int], list[float], list[float]]]:
    """Greedy ids, output logprobs and prompt logprobs of every prompt (one call, then the
    shared-prefix prompts again: a second batch on a cached prefix)."""
    rows = []
    for prompts in (PROMPTS, PROMPTS[1::2]):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0)
        for o in outs:
            meta = o["meta_info"]
            rows.append((o["output_ids"], [lp for lp, *_ in meta["output_token_logprobs"]],
                         [lp for lp, *_ in meta["input_token_logprobs"] if lp is not None]))
    return rows


def _same(rows: list[Any], want: list[Any]) -> None:
    assert [ids for ids, _, _ in rows] == [ids for ids, _, _ in want]
    worst = max(abs(a - b) for got, ref in zip(rows, want)
                for k in (1, 2) for a, b in zip(got[k], ref[k]))
    assert worst <= 1e-4


@pytest.fixture(scope="module")
def one_rank(weights: tuple[str, str]) -> Iterator[dict[str, Any]]:
    """What one rank (a thread-scheduler engine, kept as ``engine``) answers on each weight
    set."""
    for eng in thread_engine(weights[0], **FLAGS):
        out = {"w1": _rollouts(eng), "engine": eng}
        assert eng.update_weights_from_disk(weights[1])[0]
        out["w2"] = _rollouts(eng)
        assert [r[0] for r in out["w1"]] != [r[0] for r in out["w2"]]
        yield out


@pytest.fixture(scope="module")
def tp2(weights: tuple[str, str]) -> Iterator[Any]:
    from rollout_engine import Engine

    eng = Engine(model_path=weights[0], tp_size=2, dtype="float32", device="cpu", **FLAGS)
    try:
        yield eng
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_first_load_matches_one_rank(tp2, one_rank):
    _same(_rollouts(tp2), one_rank["w1"])
    info = tp2.get_server_info()
    assert info["tp_size"] == 2
    report = tp2.check_integrity()   # rank 1 ran every forward rank 0 did
    (rank1,) = report["tp_ranks"]
    assert rank1["tp_rank"] == 1 and rank1["forward_passes"] == report["tp_ranks"][0][
        "forward_passes"] > 0


def test_refit_by_disk_and_tensor_matches_one_rank(tp2, one_rank, weights):
    w1, w2 = weights
    assert tp2.update_weights_from_disk(w2, weight_version="disk") == (
        True, "updated to weight_version disk")
    _same(_rollouts(tp2), one_rank["w2"])
    ok, message = tp2.update_weights_from_tensor(list(iter_safetensors(w1)),
                                                 weight_version="tensor")
    assert ok, message
    _same(_rollouts(tp2), one_rank["w1"])


def test_refit_by_broadcast_matches_one_rank(tp2, one_rank, weights):
    from trainer_bridge import RolloutFleet, WeightSyncer

    with WeightSyncer(tp2, transport="distributed", bucket_bytes=64 << 10) as syncer:
        assert syncer.transport.world_size == 3   # the trainer and both ranks
        syncer.sync(list(iter_safetensors(weights[0])), version="broadcast")
    _same(_rollouts(tp2), one_rank["w1"])
    assert tp2.get_weight_version() == "broadcast"
    # one broadcast to a fleet of this engine and a one-rank one: 1 + 2 + 1 ranks
    with RolloutFleet([tp2, one_rank["engine"]], transport="distributed", timeout_s=60) as fleet:
        report = fleet.refit(list(iter_safetensors(weights[1])), version="fleet")
    assert report.versions == {0: "fleet", 1: "fleet"}
    _same(_rollouts(tp2), one_rank["w2"])
    _same(_rollouts(one_rank["engine"]), one_rank["w2"])


def test_sleep_and_wake_cover_every_rank(tp2, one_rank, weights):
    from rollout_engine.tokenizer_manager import EngineAsleepError

    freed = tp2.release_memory_occupation()
    per_rank = freed["tp_bytes_freed"]
    assert len(per_rank) == 2 and all(b > 0 for b in per_rank)
    assert freed["bytes_freed"] == sum(per_rank)
    with pytest.raises(EngineAsleepError):
        tp2.generate(input_ids=[1, 2], sampling_params=GREEDY)
    tp2.resume_memory_occupation()
    with pytest.raises(EngineAsleepError, match="stale"):   # zeros until every weight lands
        tp2.generate(input_ids=[1, 2], sampling_params=GREEDY)
    assert tp2.update_weights_from_disk(weights[0])[0]
    _same(_rollouts(tp2), one_rank["w1"])
    assert tp2.check_integrity()["tp_ranks"][0]["released"] == []
