"""N-gram proposals: the incremental index finds what a scan of the sequence finds."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.speculative.ngram import NgramIndex, NgramProposer, SharedNgramTable


def scan_match(ids: list[int], lo: int, hi: int) -> Optional[int]:
    """Reference: end of the latest earlier occurrence of the longest suffix, by brute force."""
    n = len(ids)
    for w in range(min(hi, n - 1), lo - 1, -1):
        for e in range(n - 1, w - 1, -1):
            if ids[e - w:e] == ids[n - w:]:
                return e
    return None


def scan_propose(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    start = scan_match(ids, lo, hi) if len(ids) >= lo + 1 else None
    if start is None or k <= 0:
        return []
    ext = list(ids)
    for j in range(k):
        ext.append(ext[start + j])
    return ext[len(ids):]


def test_continues_a_repeated_passage_from_its_longest_match() -> None:
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    ids = [1, 2] + passage + [3] + passage[:4]
    assert NgramIndex(1, 12).propose(ids, 3) == [14, 15, 16]
    # a one-token window would take the latest "13" instead: the same here, but the longest
    # match decides when the short one is ambiguous
    ids = [5, 7, 9, 5, 8, 6, 5]
    assert NgramIndex(1, 3).propose(ids, 2) == [8, 6]       # latest "5" is followed by 8
    ids = [4, 5, 7, 9, 1, 5, 8, 6, 4, 5]
    assert NgramIndex(1, 3).propose(ids, 2) == [7, 9]       # "4 5" beats the later "5"


def test_a_short_period_is_continued_past_the_sequence_end() -> None:
    ids = [3, 1, 2, 1, 2, 1, 2]
    assert NgramIndex(1, 4).propose(ids, 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(1, 4).propose([9, 9], 4) == [9, 9, 9, 9]


def test_no_earlier_occurrence_no_proposal() -> None:
    assert NgramIndex(1, 4).propose([1, 2, 3, 4], 3) == []
    assert NgramIndex(2, 4).propose([1, 2, 3, 2], 3) == []   # only 1-grams repeat
    assert NgramIndex(1, 4).propose([7], 3) == []
    assert NgramIndex(1, 4).propose([1, 1], 0) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_incremental_index_equals_a_scan(ids: list[int], lo: int, extra: int,
                                         cuts: list[int]) -> None:
    hi = lo + extra
    index = NgramIndex(lo, hi)
    n = 0
    for cut in cuts:       # the sequence grows between proposals, as a request's does
        n = min(n + cut, len(ids))
        assert index.propose(ids[:n], 4) == scan_propose(ids[:n], 4, lo, hi), ids[:n]


def test_proposer_keys_requests_and_forgets_them() -> None:
    prop = NgramProposer(1, 4)
    assert prop.propose(1, [5, 6, 5], 2) == [6, 5]
    assert prop.propose(2, [7, 8, 7], 1) == [8]
    prop.forget({2})
    assert set(prop.indexes) == {2}
    with pytest.raises(ValueError, match="n-gram windows"):
        NgramProposer(3, 2)


def test_finished_sequences_are_shared_at_the_max_window() -> None:
    prop = NgramProposer(1, 3)
    prop.publish([1, 2, 3, 4, 5, 6, 7, 8])
    assert prop.propose(1, [9, 2, 3, 4], 3) == [5, 6, 7]    # its max-window suffix was seen
    assert prop.propose(2, [9, 3, 4], 3) == []               # "3 4" is shorter: not shared
    assert prop.propose(3, [2, 3, 4, 9, 2, 3, 4], 2) == [5, 6]   # shared beats its own "2 3 4"
    assert prop.propose(4, [7, 7, 7, 7], 2) == [7, 7]        # no shared match: its own


def test_the_shared_table_is_bounded() -> None:
    table = SharedNgramTable(2, capacity=4)
    table.publish(list(range(100)))
    assert len(table.table) == 4
    assert table.continuation([96, 97], 2) == [98, 99]      # the newest entries stay
    assert table.continuation([5, 6], 2) == []               # the oldest went first
