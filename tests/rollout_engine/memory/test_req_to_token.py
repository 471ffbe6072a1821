"""ReqToTokenPool gathers writes and applies them at the next read of ``table``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.memory.kv_pool import ReqToTokenPool

ROWS, COLS = 4, 12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, ROWS - 1), st.integers(0, COLS - 1),
                          st.lists(st.integers(0, 99), min_size=1, max_size=4),
                          st.booleans()), max_size=20))
def test_reads_see_every_write_in_order(writes):
    """Against a plain tensor written immediately: the same table after any interleaving of
    writes (overlapping ones: the later wins) and reads."""
    pool = ReqToTokenPool(ROWS, COLS, torch.device("cpu"))
    want = torch.zeros(ROWS, COLS, dtype=torch.int64)
    for row, start, slots, read in writes:
        slots = slots[:COLS - start]
        pool.write(row, start, slots)
        want[row, start:start + len(slots)] = torch.tensor(slots)
        if read:
            assert torch.equal(pool.table, want)
    assert torch.equal(pool.table, want)


def test_out_of_range_writes_raise_at_once():
    pool = ReqToTokenPool(ROWS, COLS, torch.device("cpu"))
    for row, start, n in ((ROWS, 0, 1), (0, COLS - 1, 2), (-1, 0, 1), (0, -1, 1)):
        with pytest.raises(IndexError, match="outside the table"):
            pool.write(row, start, list(range(n)))
    assert int(pool.table.abs().sum()) == 0


@pytest.mark.parametrize("page_size,context_length", [(16, 100), (4, 50), (8, 41)])
def test_requests_up_to_the_context_fit_whole_page_reservations(page_size, context_length,
                                                                 qwen2_path, make_engine):
    """A context that is not a multiple of the page: requests that reach exactly the context
    length (prefilled in chunks, decoded in page runs, several at once) get their whole-page
    reservations into the table and finish by length."""
    engine = make_engine(qwen2_path, page_size=page_size, context_length=context_length,
                         chunked_prefill_size=3 * page_size + 1)
    prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)]
               for i, n in enumerate((context_length - 10, context_length - 1,
                                      context_length // 2, 1))]
    news = [context_length - len(p) for p in prompts]
    outs = engine.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0} for n in news])
    for out, n in zip(outs, news):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["completion_tokens"] == n
    engine.check_integrity()
