"""A flushed pool hands its pages out from page 0 again: the pages of a finished rollout come
back request by request, and without the rewind the next prompts' keys would land scattered
across the pool instead of in consecutive slots."""

from __future__ import annotations

import random

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.control.handlers import build_control
from rollout_engine.memory.kv_pool import PageAllocator
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.scheduler import Scheduler


@pytest.mark.parametrize("page_size", [1, 4])
def test_rewind_restarts_from_page_zero_only_when_every_page_is_free(page_size):
    alloc = PageAllocator(64 * page_size, page_size)
    taken = [alloc.allocate(1) for _ in range(64)]
    random.Random(page_size).shuffle(taken)
    for slots in taken[:-1]:
        alloc.free(slots)
    before = list(alloc._free)
    assert alloc.rewind() is False          # one page still taken: nothing moves
    assert alloc._free == before
    alloc.free(taken[-1])
    assert alloc.allocate(3) == [s for p in taken[:-4:-1] for s in p]   # LIFO without it
    alloc.free([s for p in taken[:-4:-1] for s in p])
    assert alloc.rewind() is True
    assert alloc.allocate(3) == list(range(3 * page_size))
    assert alloc.available_size() == 61 * page_size


def _msg(rid: str, ids: list[int]) -> GenerateReq:
    sp = {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3}
    return GenerateReq(rid=rid, input_ids=ids, seed=1, sampling_params=SamplingParams.from_dict(sp))


def _finish(s: Scheduler, rids: set[str]) -> None:
    for _ in range(500):
        for out in s.step().outputs:
            if out.finished_reason is not None:
                rids.discard(out.rid)
        if not rids:
            return
    raise AssertionError(f"not finished: {rids}")


def _first_prompt_slots(s: Scheduler, rid: str, ids: list[int]) -> list[int]:
    s.handle(_msg(rid, ids))
    s.step()   # the prefill
    req = s.by_rid[rid]
    slots = list(req.slots[:len(ids)])
    _finish(s, {rid})
    return slots


@pytest.mark.parametrize("how", ["flush_cache", "refit_flush"])
def test_a_flushed_scheduler_places_the_next_prompt_from_slot_zero(qwen2_path, how):
    s = Scheduler(EngineConfig(model_path=qwen2_path, device="cpu", dtype="float32",
                               scheduler_mode="thread", max_total_tokens=2048))
    rng = random.Random(0)
    for i in range(6):
        s.handle(_msg(f"r{i}", [rng.randrange(5, 500) for _ in range(40 + 7 * i)]))
    _finish(s, {f"r{i}" for i in range(6)})
    control = build_control(s)
    if how == "flush_cache":
        assert control.handlers["flush_cache"]() == {"flushed": True}
    else:   # the refit's flush: its weights written back unchanged
        control.handlers["update_weights_from_disk"](qwen2_path, flush_cache=True)
    prompt = [rng.randrange(5, 500) for _ in range(50)]
    assert _first_prompt_slots(s, "next", prompt) == list(range(50))
    s.check_integrity()
