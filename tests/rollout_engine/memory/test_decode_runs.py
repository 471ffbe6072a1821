"""Decode runs change where a request's KV lives, never what it computes: the same tokens and
logprobs with runs as one slot at a time, GRPO-style groups and mixed lengths included, and a
run's unused rest goes back to the pool when its request ends (the integrity check holds)."""

from __future__ import annotations

import random

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler import kv_manager
from rollout_engine.scheduler.scheduler import Scheduler


def _requests(rng: random.Random) -> list[GenerateReq]:
    msgs = []
    for g in range(3):
        prompt = [rng.randrange(5, 500) for _ in range(20 + 9 * g)]
        for i in range(4):    # a group sharing its prompt, each its own seed and length
            sp = {"max_new_tokens": 10 + 7 * i, "ignore_eos": True, "temperature": 0.0 if g == 0
                  else 1.0, "sampling_seed": 100 * g + i}
            msgs.append(GenerateReq(rid=f"g{g}-{i}", input_ids=prompt, seed=i,
                                    sampling_params=SamplingParams.from_dict(sp),
                                    return_logprob=True))
    return msgs


def _run(path: str, monkeypatch, run: int) -> tuple[dict, int]:
    monkeypatch.setenv(kv_manager.DECODE_RUN_ENV, str(run))
    s = Scheduler(EngineConfig(model_path=path, device="cpu", dtype="float32",
                               scheduler_mode="thread", max_total_tokens=4096))
    for msg in _requests(random.Random(0)):
        s.handle(msg)
    done, most_ahead = {}, 0
    for _ in range(500):
        for out in s.step().outputs:
            if out.finished_reason is not None:
                done[out.rid] = (out.token_ids, out.output_logprobs)
        most_ahead = max([most_ahead] + [r.slots_ahead for r in s.running])
        if not s.has_work:
            break
    s.check_integrity()
    assert s.allocator.available_size() + s.kv.tree.total_size() == s.allocator.num_slots
    return done, most_ahead


def test_runs_compute_what_single_slots_compute(qwen2_path, monkeypatch):
    runs, ahead = _run(qwen2_path, monkeypatch, kv_manager.DECODE_RUN)
    single, none_ahead = _run(qwen2_path, monkeypatch, 1)
    # seen after a step: the run's first slot took this step's KV, its second the next token's
    assert ahead == kv_manager.DECODE_RUN - 2 and none_ahead == 0
    assert len(runs) == 12 and runs.keys() == single.keys()
    for rid in runs:
        assert runs[rid][0] == single[rid][0], rid
        assert runs[rid][1] == pytest.approx(single[rid][1], abs=1e-6), rid
