"""A request's transitions: a retraction restarts what it had computed of its current phase; an
abort names a request or a group of them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.control.handlers import build_control
from rollout_engine.protocol.messages import ControlReq, GenerateReq, ReqOutput
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.request import InFlight, Req, ReqState
from rollout_engine.scheduler.scheduler import Scheduler

PROMPT_LEN = 40
CHUNK = 16
TOP = 3


def _scheduler(path: str) -> Scheduler:
    return Scheduler(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                  scheduler_mode="thread", chunked_prefill_size=CHUNK))


def _req(rid: str, ids: list[int]) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=list(ids), seed=0, return_logprob=True,
                       top_logprobs_num=TOP, logprob_start_len=0,
                       sampling_params=SamplingParams.from_dict(
                           {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}))


def _control(s: Scheduler, method: str, **kwargs: Any) -> None:
    """Run a control call over ``s`` (the plane holds no state of its own between these)."""
    result = build_control(s).handle(ControlReq(method=method, kwargs=kwargs))
    assert result is not None and result.success, result


def _finish(s: Scheduler, rid: str) -> ReqOutput:
    for _ in range(200):
        for out in s.step().outputs:
            if out.rid == rid and out.finished_reason is not None:
                return out
    raise AssertionError(f"{rid} never finished")


@pytest.mark.parametrize("chunks_before", [1, 2])
def test_retract_mid_prefill_restarts_the_prompt_logprobs(chunks_before, qwen2_path):
    """``pause_generation(mode="retract")`` between two chunks of a prefill, then
    ``continue_generation``: the prompt logprobs are those of a run never paused, one entry
    per prompt position, none repeated."""
    s = _scheduler(qwen2_path)
    ids = [random.Random(5).randrange(5, 500) for _ in range(PROMPT_LEN)]
    s.handle(_req("plain", ids))
    plain = _finish(s, "plain")
    s.handle(_req("paused", ids))
    for _ in range(chunks_before):
        s.step()
    req = s.by_rid["paused"]
    assert req.state == ReqState.PREFILL and req.kv_len == chunks_before * CHUNK
    _control(s, "pause_generation", mode="retract")
    assert req.state == ReqState.WAITING and not req.slots
    _control(s, "continue_generation")
    paused = _finish(s, "paused")
    assert plain.input_logprobs is not None and paused.input_logprobs is not None
    assert len(plain.input_logprobs) == PROMPT_LEN
    assert len(paused.input_logprobs) == PROMPT_LEN
    assert paused.input_logprobs[0] is None and plain.input_logprobs[0] is None
    assert paused.input_logprobs[1:] == pytest.approx(plain.input_logprobs[1:], abs=1e-5)
    assert plain.input_top_logprobs is not None and paused.input_top_logprobs is not None
    assert len(paused.input_top_logprobs) == PROMPT_LEN
    assert [[t for _, t in top] for top in paused.input_top_logprobs[1:]] == \
        [[t for _, t in top] for top in plain.input_top_logprobs[1:]]
    assert paused.token_ids == plain.token_ids
    assert paused.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-5)
    assert s.check_integrity()["idle"]


def test_retract_in_decode_keeps_the_finished_prompt_logprobs(qwen2_path):
    """A request retracted after its prefill keeps its prompt logprobs (their phase is over)
    and its streamed outputs; the recompute adds none."""
    s = _scheduler(qwen2_path)
    ids = [random.Random(6).randrange(5, 500) for _ in range(PROMPT_LEN)]
    s.handle(_req("plain", ids))
    plain = _finish(s, "plain")
    s.handle(_req("paused", ids))
    req = s.by_rid["paused"]
    while req.state != ReqState.DECODE:
        s.step()
    s.step()
    _control(s, "pause_generation", mode="retract")
    assert req.state == ReqState.WAITING and len(req.input_logprobs) == PROMPT_LEN
    _control(s, "continue_generation")
    paused = _finish(s, "paused")
    assert len(paused.input_logprobs) == PROMPT_LEN
    assert paused.input_logprobs[1:] == pytest.approx(plain.input_logprobs[1:], abs=1e-5)
    assert paused.token_ids == plain.token_ids
    assert s.check_integrity()["idle"]


def test_in_flight_names_a_rid_or_every_member_of_a_group():
    def req(rid: str, *groups: str) -> Req:
        msg = GenerateReq(rid=rid, input_ids=[1], seed=0, groups=groups,
                          sampling_params=SamplingParams.from_dict({}))
        return Req(msg, 0)

    inflight = InFlight()
    members = [req("b_0-0", "b", "b_0"), req("b_0-1", "b", "b_0"), req("b_1-0", "b", "b_1")]
    lone, twin = req("b"), req("b_0-1")
    for r in (*members, lone):
        inflight.add(r)

    def rids(name: str) -> list[str]:
        return sorted(r.rid for r in inflight.named(name))

    assert rids("b") == ["b", "b_0-0", "b_0-1", "b_1-0"]
    assert rids("b_0") == ["b_0-0", "b_0-1"]
    assert rids("b_1-0") == ["b_1-0"]
    assert rids("b_") == []
    inflight.remove(twin)   # not the request in flight under that rid: nothing changes
    assert rids("b_0") == ["b_0-0", "b_0-1"]
    for r in members:
        inflight.remove(r)
    assert rids("b") == ["b"] and rids("b_0") == []
    inflight.remove(lone)
    assert inflight.by_rid == {} and rids("b") == []
