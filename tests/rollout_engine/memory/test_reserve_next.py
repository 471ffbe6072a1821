"""A decode step's reservation in one pass (``KVManager.reserve_next``) takes exactly what one
``reserve`` per request would (decode runs off): the same pages in the same order, the same table
rows, the same ``ReqToTokenPool.generation``; and when the free pages do not cover every request
it takes nothing (the scheduler then reserves one by one, evicting as needed). With decode runs,
a request short of a page takes a run of consecutive slots, at most what it can still fill, and
only while twice the runs' pages are free; admission does not count a run's rest twice."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rollout_engine.memory.kv_pool import PageAllocator, ReqToTokenPool
from rollout_engine.memory.prefix_cache import NoPrefixCache
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler import kv_manager
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.policy import NewTokenRatio
from rollout_engine.scheduler.request import Req

ROWS, WIDTH = 12, 96


def _state(seed: int, page_size: int, num_pages: int, runs: bool = False
           ) -> tuple[KVManager, list[SimpleNamespace]]:
    """Requests each holding whole pages, some of them a page short of their
    next position (the same for every call with the same arguments)."""
    rng = random.Random(seed)
    allocator = PageAllocator(num_pages * page_size, page_size)
    rtt = ReqToTokenPool(ROWS, WIDTH, torch.device("cpu"))
    kv = KVManager(allocator, rtt, NoPrefixCache(page_size=page_size))
    if not runs:
        kv.run_pages = 1
    reqs = []
    for _ in range(rng.randint(1, ROWS)):
        row = rtt.allocate()
        held = rng.randint(1, 4)
        slots = allocator.allocate(held)
        assert slots is not None and row is not None
        rtt.write(row, 0, slots)
        # the next position inside the last page, at its end, or a page past it
        kv_len = len(slots) - rng.choice([1, 0, 0, -page_size]) - rng.randrange(page_size)
        reqs.append(_req(row, slots, min(kv_len, len(slots) + page_size - 1)))
    rng.shuffle(reqs)
    return kv, reqs


def _req(row: int, slots: list[int], kv_len: int, max_new_tokens: int = 64) -> SimpleNamespace:
    """A decoding request at position ``kv_len`` (its sequence ``kv_len + 1`` long) whose prompt
    is its first 4 positions."""
    return SimpleNamespace(req_pool_idx=row, slots=list(slots), kv_len=kv_len,
                           input_ids=[0] * 4, output_ids=[0] * (kv_len - 3),
                           all_ids=[0] * (kv_len + 1),
                           params=SimpleNamespace(max_new_tokens=max_new_tokens),
                           slots_ahead=max(len(slots) - kv_len - 1, 0))


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


def _decoding(kv: KVManager, n: int, max_new_tokens: int = 64) -> list[SimpleNamespace]:
    """``n`` requests with a 4-token prompt in their own pages, each at its first decode step."""
    reqs = []
    for _ in range(n):
        row = kv.req_to_token.allocate()
        slots = kv.allocator.allocate(-(-4 // kv.page_size))
        kv.req_to_token.write(row, 0, slots)
        reqs.append(_req(row, slots, 4, max_new_tokens))
    return reqs


def _step(reqs: list[SimpleNamespace]) -> None:
    for r in reqs:
        r.kv_len += 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_short_of_a_page_takes_a_run_of_consecutive_slots(page_size):
    kv = KVManager(PageAllocator(4096, page_size), ReqToTokenPool(ROWS, 256, torch.device("cpu")),
                   NoPrefixCache(page_size=page_size))
    assert kv.run_pages * page_size == kv_manager.DECODE_RUN
    reqs = _decoding(kv, 4)
    assert kv.reserve_next(reqs)
    for r in reqs:
        own = r.slots[4:]
        assert len(own) == kv_manager.DECODE_RUN
        assert own == list(range(own[0], own[0] + len(own)))          # consecutive
        assert kv.req_to_token.table[r.req_pool_idx, 4:len(r.slots)].tolist() == own
    free = kv.allocator.available_size()
    # the run covers the next steps: nothing more is taken until it is used up
    for _ in range(kv_manager.DECODE_RUN - 1):
        _step(reqs)
        assert kv.reserve_next(reqs)
        assert kv.allocator.available_size() == free
    _step(reqs)
    assert kv.reserve_next(reqs)
    assert kv.allocator.available_size() == free - 4 * kv_manager.DECODE_RUN


def test_a_run_stops_where_the_request_can_fill_no_more():
    kv = KVManager(PageAllocator(4096, 1), ReqToTokenPool(ROWS, 256, torch.device("cpu")),
                   NoPrefixCache(page_size=1))
    reqs = _decoding(kv, 2, max_new_tokens=6)   # KV for positions 0..8: 9 slots in all
    assert kv.reserve_next(reqs)
    assert [len(r.slots) for r in reqs] == [9, 9]


@pytest.mark.parametrize("spare", [-1, 0])
def test_no_runs_unless_twice_their_pages_are_free(spare):
    run = kv_manager.DECODE_RUN
    kv = KVManager(PageAllocator(4 * 4 + 2 * 4 * run + spare, 1),
                   ReqToTokenPool(ROWS, 256, torch.device("cpu")), NoPrefixCache(page_size=1))
    reqs = _decoding(kv, 4)
    assert kv.allocator.available_size() == 2 * 4 * run + spare
    assert kv.reserve_next(reqs)
    # one page short of twice the runs: just the next position; twice the runs: the runs
    assert [len(r.slots) for r in reqs] == [5 if spare < 0 else 4 + run] * 4


def test_admission_does_not_count_a_runs_rest_twice():
    ratio = NewTokenRatio()
    ratio.value = 1.0
    req = _req(0, list(range(20)), 4, max_new_tokens=64)    # 15 slots past its sequence
    assert req.slots_ahead == 15
    assert ratio.expected_new_tokens(req) == 64 - 1 - 15
    assert ratio.expected_new_tokens(_req(0, list(range(5)), 4, max_new_tokens=64)) == 63
    real = Req(GenerateReq(rid="a", input_ids=[5, 6, 7, 8], seed=0,
                           sampling_params=SamplingParams.from_dict({"max_new_tokens": 64})), 0)
    real.append_output(9)
    real.slots = list(range(20))
    assert real.slots_ahead == 15
    assert ratio.expected_new_tokens(real) == 64 - 1 - 15
    real.slots = list(range(4))      # a chunked prompt: none ahead
    assert real.slots_ahead == 0


def test_decode_run_env(monkeypatch):
    monkeypatch.setenv(kv_manager.DECODE_RUN_ENV, "1")
    kv = KVManager(PageAllocator(64, 1), ReqToTokenPool(ROWS, 64, torch.device("cpu")),
                   NoPrefixCache(page_size=1))
    assert kv.run_pages == 1
    monkeypatch.setenv(kv_manager.DECODE_RUN_ENV, "zero")
    with pytest.raises(ValueError, match="ROLLOUT_ENGINE_DECODE_RUN"):
        kv_manager.decode_run_tokens()
