"""Admission never blocks on storage reads: a request whose L3 prefetch is in flight waits
aside (by its policy) while the requests behind it are admitted and run; outputs unchanged."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.request import ReqState
from rollout_engine.scheduler.scheduler import Scheduler

PROMPT_A = [(7 * i) % 200 + 3 for i in range(80)]      # 5 storage blocks of 16 tokens
PROMPT_B = [(11 * i) % 190 + 5 for i in range(40)]     # never stored: nothing to prefetch
BLOCK = 16


def _scheduler(path: str, storage_dir: Any = None, **flags: Any) -> Scheduler:
    if storage_dir is not None:
        flags.update(enable_hierarchical_cache=True, hicache_ratio=4.0,
                     hicache_storage_backend="file", hicache_storage_dir=str(storage_dir),
                     hicache_storage_block_tokens=BLOCK)
    return Scheduler(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                  scheduler_mode="thread", debug_integrity=True, **flags))


def _submit(s: Scheduler, rid: str, ids: list[int]) -> None:
    s.handle(GenerateReq(rid=rid, input_ids=ids, seed=0, sampling_params=SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 6})))


def _run(s: Scheduler, done: dict[str, Any], until: str, max_steps: int = 3000) -> None:
    """Step until ``until`` has its final output (an idle step waits <= 10 ms on a read)."""
    for _ in range(max_steps):
        for out in s.step().outputs:
            if out.finished_reason is not None:
                done[out.rid] = out
        if until in done:
            return
    raise AssertionError(f"{until} never finished; done: {sorted(done)}")


@pytest.fixture(scope="module")
def reference(qwen2_path) -> dict[str, list[int]]:
    """A's and B's greedy outputs on an engine without HiCache."""
    s = _scheduler(qwen2_path)
    done: dict[str, Any] = {}
    _submit(s, "A", PROMPT_A)
    _submit(s, "B", PROMPT_B)
    _run(s, done, "A")
    _run(s, done, "B")
    s.shutdown()
    return {rid: out.token_ids for rid, out in done.items()}


def _gate_reads(s: Scheduler) -> threading.Event:
    """Every storage read of ``s`` blocks until the returned event is set (a slow L3; after
    20 s the gate opens by itself, so an admission that blocks on it fails the test instead of
    hanging)."""
    storage = s.kv.tree.storage.storage
    gate, read = threading.Event(), storage.get

    def slow_get(key: str):
        if not gate.wait(20):
            gate.set()
        return read(key)

    storage.get = slow_get
    return gate


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
def test_request_behind_a_slow_storage_read_is_admitted_first(qwen2_path, tmp_path, reference,
                                                              policy):
    first = _scheduler(qwen2_path, tmp_path)             # computes A; its blocks reach L3
    done: dict[str, Any] = {}
    _submit(first, "A", PROMPT_A)
    _run(first, done, "A")
    first.shutdown()
    assert done["A"].token_ids == reference["A"]

    s = _scheduler(qwen2_path, tmp_path, hicache_storage_prefetch_policy=policy)
    gate = _gate_reads(s)
    try:
        done = {}
        _submit(s, "A", PROMPT_A)                        # its prefetch hangs on the gate
        _submit(s, "B", PROMPT_B)
        _run(s, done, "B")
        if policy == "wait_complete":                    # A waited aside, B went ahead
            assert "A" not in done
            assert s.by_rid["A"].state == ReqState.WAITING and s.waiting[0].rid == "A"
        gate.set()
        _run(s, done, "A")
    finally:
        gate.set()
        s.shutdown()
    assert done["A"].token_ids == reference["A"] and done["B"].token_ids == reference["B"]
    stored = s.kv.tree.tier_stats()["storage_hit_tokens"]
    if policy == "wait_complete":                        # A was served from L3 once read
        assert done["A"].cached_tokens == stored == (len(PROMPT_A) - 1) // BLOCK * BLOCK
    else:                                                # best effort: nothing staged yet
        assert done["A"].cached_tokens == stored == 0
    assert done["B"].cached_tokens == 0
