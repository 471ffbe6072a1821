"""The dispatch policies on their own: round robin cycles, shortest queue follows the loads,
cache_aware follows a prompt's prefix unless the replicas are imbalanced."""

from __future__ import annotations

import pytest

from rollout_engine.dp.dispatch import (
    BLOCK_TOKENS,
    CacheAware,
    Load,
    create_dispatcher,
    prefix_keys,
)


def _send(d, ids, loads):
    r = d.pick(ids, loads)
    d.record(ids, r)
    loads[r].requests += 1
    return r


def test_round_robin_cycles_whatever_the_loads():
    d = create_dispatcher("round_robin", 3)
    loads = [Load(requests=9), Load(), Load()]
    assert [_send(d, [1, 2], loads) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert type(create_dispatcher("auto", 2)) is type(d)


@pytest.mark.parametrize("method", ["total_requests", "shortest_queue"])
def test_shortest_queue_picks_the_fewest_requests(method):
    d = create_dispatcher(method, 3)
    assert d.pick([1], [Load(3), Load(1), Load(2)]) == 1
    assert d.pick([1], [Load(1, 50), Load(1, 10), Load(2)]) == 1   # ties: fewer tokens
    by_tokens = create_dispatcher("total_tokens", 2)
    assert by_tokens.pick([1], [Load(1, 90), Load(5, 10)]) == 1


def test_prefix_keys_name_whole_prefixes():
    a = list(range(40))
    b = a[:BLOCK_TOKENS] + [999] * 24
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == 40 // BLOCK_TOKENS
    assert ka[0] == kb[0] and ka[1] != kb[1]
    assert prefix_keys(a[:BLOCK_TOKENS - 1]) == []


def test_cache_aware_follows_the_prefix_and_falls_back_to_load():
    d = CacheAware(2, balance_abs_threshold=4, balance_rel_threshold=1.5)
    loads = [Load(), Load()]
    system = list(range(100, 164))             # a 64-token shared prefix
    first = _send(d, system + [1, 2], loads)
    # the least loaded replica would be the other one; the prefix wins
    assert all(_send(d, system + [i, i + 1], loads) == first for i in range(3, 6))
    other = 1 - first
    # an unrelated prompt goes to the least loaded replica
    assert _send(d, list(range(500, 540)), loads) == other
    # imbalanced beyond both thresholds: load wins over the prefix
    loads[first].requests, loads[other].requests = 20, 2
    assert d.pick(system + [7, 8], loads) == other
    assert d.matched_blocks(system + [7, 8])[first] == 64 // BLOCK_TOKENS


def test_a_short_match_does_not_pull():
    d = CacheAware(2, cache_threshold=0.5)
    loads = [Load(), Load()]
    head = list(range(BLOCK_TOKENS))
    r = _send(d, head + [1], loads)
    loads[r].requests += 1
    # one matching block of a 100-token prompt is under the threshold: least loaded instead
    assert d.pick(head + list(range(1000, 1084)), loads) == 1 - r


def test_unknown_method_names_the_field():
    with pytest.raises(ValueError, match="load_balance_method"):
        create_dispatcher("follow_bootstrap_room", 2)
