"""--tp-size 2 on two GPUs (nccl; the same code path as gloo on CPU): float32 greedy tokens equal
one GPU's, and a refit from disk lands on both ranks. Needs two CUDA devices (skipped
otherwise)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 300, 17], list(range(40, 70))]


def _ids(engine):
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_two_gpus_answer_like_one_before_and_after_a_refit():
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path

    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    want = {}
    one = Engine(model_path=w1, device="cuda", dtype="float32", max_total_tokens=2048)
    try:
        want["w1"] = _ids(one)
        assert one.update_weights_from_disk(w2)[0]
        want["w2"] = _ids(one)
    finally:
        one.shutdown()
    two = Engine(model_path=w1, device="cuda", dtype="float32", tp_size=2,
                 max_total_tokens=2048)
    try:
        assert _ids(two) == want["w1"]
        assert two.update_weights_from_disk(w2)[0]
        assert _ids(two) == want["w2"]
        assert two.check_integrity()["tp_ranks"][0]["tp_rank"] == 1
    finally:
        two.shutdown()
