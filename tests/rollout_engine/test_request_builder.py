"""RequestBuilder names the requests a generate call expands to and the groups they belong to."""

from __future__ import annotations

import random

from rollout_engine.request_builder import RequestBuilder, RequestLimits


def _build(**kw):
    builder = RequestBuilder(tokenizer=None, vocab_size=64, context_len=1000,
                             rng=random.Random(0),
                             limits=RequestLimits(20, 64, 256, 1024))
    reqs, _ = builder.build(**kw)
    return [(r.rid, r.groups) for r in reqs]


def test_a_single_request_belongs_to_no_group():
    assert _build(input_ids=[1, 2], rid="a") == [("a", ())]


def test_samples_and_batch_members_belong_to_the_callers_rid():
    assert _build(input_ids=[1, 2], rid="g", sampling_params={"n": 2}) == [
        ("g-0", ("g",)), ("g-1", ("g",))]
    assert _build(input_ids=[[1], [2]], rid="b") == [("b_0", ("b",)), ("b_1", ("b",))]
    # a batch's samples: the call's rid, then their prompt's
    assert _build(input_ids=[[1], [2]], rid="b", sampling_params={"n": 2}) == [
        ("b_0-0", ("b", "b_0")), ("b_0-1", ("b", "b_0")),
        ("b_1-0", ("b", "b_1")), ("b_1-1", ("b", "b_1"))]
    # rids given per prompt: each prompt's samples are its group, the batch has no name
    assert _build(input_ids=[[1], [2]], rid=["x", "y"], sampling_params={"n": 2}) == [
        ("x-0", ("x",)), ("x-1", ("x",)), ("y-0", ("y",)), ("y-1", ("y",))]
    assert _build(input_ids=[[1], [2]], rid=["x", "y"]) == [("x", ()), ("y", ())]
