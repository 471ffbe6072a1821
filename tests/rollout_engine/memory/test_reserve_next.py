"""A decode step's reservation in one pass (``KVManager.reserve_next``) takes exactly what one
``reserve`` per request would: the same pages in the same order, the same table rows, the same
``ReqToTokenPool.generation``; and when the free pages do not cover every request it takes
nothing (the scheduler then reserves one by one, evicting as needed)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rollout_engine.memory.kv_pool import PageAllocator, ReqToTokenPool
from rollout_engine.memory.prefix_cache import NoPrefixCache
from rollout_engine.scheduler.kv_manager import KVManager

ROWS, WIDTH = 12, 96


def _state(seed: int, page_size: int, num_pages: int) -> tuple[KVManager, list[SimpleNamespace]]:
    """Requests each holding whole pages, some of them a page short of their
    next position (the same for every call with the same arguments)."""
    rng = random.Random(seed)
    allocator = PageAllocator(num_pages * page_size, page_size)
    rtt = ReqToTokenPool(ROWS, WIDTH, torch.device("cpu"))
    kv = KVManager(allocator, rtt, NoPrefixCache(page_size=page_size))
    reqs = []
    for _ in range(rng.randint(1, ROWS)):
        row = rtt.allocate()
        held = rng.randint(1, 4)
        slots = allocator.allocate(held)
        assert slots is not None and row is not None
        rtt.write(row, 0, slots)
        # the next position inside the last page, at its end, or a page past it
        kv_len = len(slots) - rng.choice([1, 0, 0, -page_size]) - rng.randrange(page_size)
        reqs.append(SimpleNamespace(req_pool_idx=row, slots=list(slots),
                                    kv_len=min(kv_len, len(slots) + page_size - 1)))
    rng.shuffle(reqs)
    return kv, reqs


def _snapshot(kv: KVManager, reqs: list[SimpleNamespace]) -> tuple:
    return (list(kv.allocator._free), [list(r.slots) for r in reqs],
            kv.req_to_token.table.clone(), kv.req_to_token.generation)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(20))
def test_one_pass_takes_what_one_reserve_each_takes(seed, page_size):
    one_pass, reqs = _state(seed, page_size, num_pages=80)
    assert one_pass.reserve_next(reqs)
    each, reqs_each = _state(seed, page_size, num_pages=80)
    for r in reqs_each:
        assert each.reserve(r, r.kv_len + 1)
    got, want = _snapshot(one_pass, reqs), _snapshot(each, reqs_each)
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    assert torch.equal(got[2], want[2])
    assert all(len(r.slots) > r.kv_len for r in reqs)


@pytest.mark.parametrize("seed", range(10))
def test_short_of_pages_it_takes_nothing(seed):
    kv, reqs = _state(seed, 1, num_pages=ROWS * 4)
    kv.allocator.allocate(len(kv.allocator._free))        # nothing left
    short = [r for r in reqs if len(r.slots) <= r.kv_len]
    before = _snapshot(kv, reqs)
    assert kv.reserve_next(reqs) is (not short)
    after = _snapshot(kv, reqs)
    assert before[:2] == after[:2] and before[3] == after[3]
    assert torch.equal(before[2], after[2])
