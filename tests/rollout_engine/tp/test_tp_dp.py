"""--dp-size 2 --tp-size 2: two replicas of two ranks each (five processes) answer like one rank,
and one broadcast refits all four ranks (replica i's ranks join at rank_offset + 2 i + r)."""

from __future__ import annotations

import pytest

from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import thread_engine

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
PROMPTS = [[1, 2, 3], [9, 30, 200, 11], [5, 6], [70, 71, 72, 73, 74]]


def _rollouts(engine):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _same(rows, want):
    assert [ids for ids, _ in rows] == [ids for ids, _ in want]
    assert max(abs(a - b) for (_, x), (_, y) in zip(rows, want) for a, b in zip(x, y)) <= 1e-4


@pytest.mark.slow
def test_two_replicas_of_two_ranks_answer_and_refit_like_one_rank():
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path
    from trainer_bridge import WeightSyncer

    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    want = {}
    for eng in thread_engine(w1, max_total_tokens=512):
        want["w1"] = _rollouts(eng)
        assert eng.update_weights_from_disk(w2)[0]
        want["w2"] = _rollouts(eng)
    eng = Engine(model_path=w1, dtype="float32", device="cpu", dp_size=2, tp_size=2,
                 load_balance_method="round_robin", max_total_tokens=512)
    try:
        _same(_rollouts(eng), want["w1"])
        with WeightSyncer(eng, transport="distributed") as syncer:
            assert syncer.transport.world_size == 5   # the trainer and 2 x 2 ranks
            syncer.sync(list(iter_safetensors(w2)), version="broadcast")
        _same(_rollouts(eng), want["w2"])
        assert [r["weight_version"] for r in eng.get_server_info()["dp_results"]] == [
            "broadcast", "broadcast"]
    finally:
        eng.shutdown()
