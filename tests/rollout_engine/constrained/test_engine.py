"""Structured output through the real Engine (scheduler, radix cache, sampler) on the
random-weight tiny Qwen2, which would otherwise emit garbage: every output of a grammar request
parses / matches / validates, greedy and sampled, n = 8; the returned logprobs are the unmasked
ones unless return_masked_logprobs, which equals log_softmax over the tokens xgrammar allows;
unconstrained neighbours in the batch are token-identical to a run without the grammar
request; retraction under a tiny KV pool keeps grammar outputs valid and leaks nothing."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.rollout_engine.constrained.test_generation import EBNF, REGEXES, _is_expression, _object
from tests.rollout_engine.engines import thread_engine

N = 8
MAX_NEW = 400
PROMPTS = ["Answer in JSON:", "Answer in JSON:"]   # twice: the second hits the radix cache


@pytest.fixture(scope="module")
def engine(tiny_dir: str) -> Iterator[Any]:
    # compact JSON (SGLang's --constrained-json-disable-any-whitespace): under greedy decoding
    # the random model given any whitespace emits it forever
    # top logprobs over the whole (tiny) vocabulary: the masked-logprob test reads them all
    yield from thread_engine(tiny_dir, context_length=1024,
                             constrained_json_disable_any_whitespace=True,
                             max_top_logprobs_num=1024)


def _params(greedy: bool, seed: int, **kw: Any) -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "n": N, "temperature": 0.0 if greedy else 1.0,
            "sampling_seed": seed, **kw}


def _texts(outs: list[dict[str, Any]]) -> list[str]:
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o["meta_info"]
    return [o["text"] for o in outs]


# bounded, so a random model must end: integers in a range (an unbounded one can take digits
# forever), strings and arrays with a maxLength / maxItems, enums, booleans
_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
              st.integers(1, 3), st.integers(0, 3)),
    st.builds(lambda vals: {"enum": vals}, st.one_of(
        st.lists(st.text("abc xyz", max_size=4), min_size=1, max_size=3, unique=True),
        st.lists(st.integers(-9, 99), min_size=1, max_size=3, unique=True))),
)
_schemas = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
              inner, st.integers(0, 3)),
    st.builds(_object, st.dictionaries(st.sampled_from(["a", "bb", "c_d", "name"]), inner,
                                       min_size=1, max_size=3),
              st.lists(st.booleans(), min_size=3, max_size=3)),
), max_leaves=5)


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas, greedy=st.booleans(), seed=st.integers(0, 2**16))
def test_random_schemas_validate(engine: Any, schema: dict[str, Any], greedy: bool,
                                 seed: int) -> None:
    outs = engine.generate(prompt=PROMPTS, sampling_params=_params(
        greedy, seed, json_schema=json.dumps(schema)))
    assert len(outs) == N * len(PROMPTS)
    for text in _texts(outs):
        jsonschema.validate(json.loads(text), schema)
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_regexes_and_ebnf(engine: Any, greedy: bool) -> None:
    for regex in REGEXES:
        outs = engine.generate(prompt=PROMPTS, sampling_params=_params(greedy, 5, regex=regex))
        for text in _texts(outs):
            assert re.fullmatch(regex, text), (regex, text)
    outs = engine.generate(prompt=PROMPTS[:1], sampling_params=_params(greedy, 9, ebnf=EBNF))
    for text in _texts(outs):
        assert _is_expression(text), text


def test_grammar_ends_under_ignore_eos_and_min_new_tokens(engine: Any) -> None:
    outs = engine.generate(prompt="x", sampling_params=_params(
        False, 3, regex="(yes|no)", ignore_eos=True, min_new_tokens=50))
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        assert o["text"] in ("yes", "no")


def _replay_allowed(tiny_dir: str, regex: str, output_ids: list[int]) -> list[torch.Tensor]:
    """The allowed-token sets xgrammar itself computes at each output position."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from rollout_engine.constrained.matcher import unpack_bitmask

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    vocab = json.load(open(f"{tiny_dir}/config.json"))["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    allowed = []
    for t in output_ids:
        bm = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bm)
        allowed.append(unpack_bitmask(bm, vocab)[0])
        assert matcher.accept_token(t)
    return allowed


def test_masked_logprobs_match_an_xgrammar_reference(engine: Any, tiny_dir: str) -> None:
    """Same seed, same tokens; the default logprobs are the unmasked log_softmax(logits / T)
    (an unconstrained distribution over the full vocabulary), the flag's are log_softmax over
    exactly the tokens xgrammar allows, and no token outside them is ever sampled."""
    vocab = engine.tm.vocab_size
    regex = r"[a-f]{2,5}(-[0-9]{1,3}){1,2}"
    base = {"max_new_tokens": 60, "temperature": 0.8, "sampling_seed": 11, "regex": regex}
    kw = {"return_logprob": True, "top_logprobs_num": vocab}
    plain = engine.generate(prompt="hello", sampling_params=base, **kw)
    masked = engine.generate(prompt="hello", sampling_params={
        **base, "return_masked_logprobs": True}, **kw)
    assert plain["output_ids"] == masked["output_ids"]
    assert re.fullmatch(regex, plain["text"])
    ids = plain["output_ids"]
    allowed = _replay_allowed(tiny_dir, regex, ids[:-1])   # the last one is EOS (ends it)
    for k, ok in enumerate(allowed):
        full = dict((t, lp) for lp, t, _ in plain["meta_info"]["output_top_logprobs"][k])
        assert len(full) == vocab and math.isclose(
            sum(math.exp(v) for v in full.values()), 1.0, rel_tol=1e-4)
        assert ok[ids[k]], "a token outside xgrammar's mask was sampled"
        allowed_ids = set(ok.nonzero().squeeze(1).tolist())
        lse = math.log(sum(math.exp(full[t]) for t in allowed_ids))
        lp_plain = plain["meta_info"]["output_token_logprobs"][k][0]
        lp_masked = masked["meta_info"]["output_token_logprobs"][k][0]
        assert math.isclose(lp_plain, full[ids[k]], abs_tol=1e-6)
        assert math.isclose(lp_masked, full[ids[k]] - lse, abs_tol=1e-4)
        top = masked["meta_info"]["output_top_logprobs"][k]
        assert {t for _, t, _ in top} == allowed_ids
        for lp, t, _ in top:
            assert math.isclose(lp, full[t] - lse, abs_tol=1e-4)


def test_neighbours_are_token_identical(engine: Any) -> None:
    """A grammar request in the batch changes nothing for the unconstrained ones."""
    prompts = ["one two three", "four five", "six"]
    free = [{"max_new_tokens": 24, "temperature": 0.0},
            {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 1},
            {"max_new_tokens": 24, "temperature": 0.7, "top_k": 20, "sampling_seed": 2}]
    engine.flush_cache()
    alone = engine.generate(prompt=prompts, sampling_params=free)
    engine.flush_cache()
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}}, "required": ["a"]}
    mixed = engine.generate(prompt=[prompts[0], "grammar", *prompts[1:]], sampling_params=[
        free[0], {"max_new_tokens": 40, "json_schema": json.dumps(schema), "temperature": 1.0},
        *free[1:]])
    got = [mixed[0], *mixed[2:]]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in alone]
    jsonschema.validate(json.loads(mixed[1]["text"]), schema)


def test_retraction_under_a_tiny_kv_pool(tiny_dir: str) -> None:
    from rollout_engine import Engine

    schema = {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": 12, "maxItems": 16},
        "s": {"type": "string", "minLength": 16, "maxLength": 20}}, "required": ["xs", "s"]}
    eng = Engine(model_path=tiny_dir, scheduler_mode="thread", dtype="float32", device="cpu",
                 context_length=512, max_total_tokens=192,
                 constrained_json_disable_any_whitespace=True)
    try:
        outs = eng.generate(prompt=["a b c d e f g h"] * 2, sampling_params={
            "max_new_tokens": 150, "n": 8, "temperature": 1.0, "sampling_seed": 4,
            "json_schema": json.dumps(schema)})
        assert eng.get_server_info()["stats"]["num_retractions"] > 0
        for text in _texts(outs):
            jsonschema.validate(json.loads(text), schema)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_bad_grammars_disturb_nothing(engine: Any) -> None:
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app

    with TestClient(create_app(engine)) as client:
        bad = [{"regex": "(a"}, {"ebnf": "root ::= nothing_defined"},
               {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}},
               {"regex": "a", "ebnf": 'root ::= "a"'}]
        for params in bad:
            r = client.post("/generate", json={"text": "hi", "sampling_params": {
                "max_new_tokens": 4, **params}})
            assert r.status_code == 400, r.text
            assert "sampling_params." in r.json()["error"]["message"]
        ok = client.post("/generate", json={"text": ["hi", "yo"], "sampling_params": [
            {"max_new_tokens": 6, "temperature": 0.0},
            {"max_new_tokens": 30, "regex": "(yes|no)"}]})
        assert ok.status_code == 200, ok.text
        assert ok.json()[1]["text"] in ("yes", "no")
    report = engine.check_integrity()
    assert report["idle"] and report["owned_tokens"] == 0


def test_a_compile_failure_ends_that_request_alone(tiny_dir: str) -> None:
    """What only the tokenizer-level compile finds: an abort finish reason for that request;
    its batch neighbours finish normally."""
    from rollout_engine.config import EngineConfig
    from rollout_engine.protocol.messages import GenerateReq
    from rollout_engine.sampling_params import SamplingParams
    from rollout_engine.scheduler.scheduler import Scheduler

    s = Scheduler(EngineConfig(model_path=tiny_dir, dtype="float32", device="cpu",
                               context_length=256, max_total_tokens=1024))
    try:
        real = s.grammars.backend.compile

        def compile_(c: Any) -> Any:
            if c.spec != "zzz":
                return real(c)
            fut: Future[Any] = Future()
            fut.set_exception(ValueError("sampling_params.regex: xgrammar cannot compile this "
                                         "regex: x"))
            return fut
        s.grammars.backend.compile = compile_   # type: ignore[method-assign]
        for rid, regex in (("bad", "zzz"), ("good", "(yes|no)")):
            s.handle(GenerateReq(rid, [5, 6, 7], SamplingParams(max_new_tokens=20, regex=regex),
                                 seed=1))
        s.handle(GenerateReq("free", [5, 6, 8], SamplingParams(max_new_tokens=5), seed=2))
        done: dict[str, Any] = {}
        for _ in range(200):
            for o in s.step().outputs:
                if o.finished_reason is not None:
                    done[o.rid] = o
            if len(done) == 3:
                break
        assert done["bad"].finished_reason == {
            "type": "abort", "message": "sampling_params.regex: xgrammar cannot compile this "
                                        "regex: x"}
        assert done["good"].finished_reason["type"] == "stop"
        assert done["free"].finished_reason["type"] == "length"
        assert s.check_integrity()["idle"]
    finally:
        s.shutdown()


def test_chunked_prefill_and_pause_retract(tiny_dir: str) -> None:
    """Long prompts prefilled in chunks (only the last chunk samples, under the grammar), then
    pause_generation(mode="retract") mid-decode and continue: outputs still validate."""
    import threading
    import time

    from rollout_engine import Engine

    schema = {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 60, "maxItems": 64}}, "required": ["xs"]}   # ~250 tokens
    eng = Engine(model_path=tiny_dir, scheduler_mode="thread", dtype="float32", device="cpu",
                 context_length=512, chunked_prefill_size=16,
                 constrained_json_disable_any_whitespace=True)
    try:
        result: dict[str, Any] = {}

        def run() -> None:
            result["outs"] = eng.generate(prompt=["a b c d e f g h i j k l m n o p q r s t"] * 2,
                                          sampling_params={
                                              "max_new_tokens": 400, "n": 4, "temperature": 1.0,
                                              "sampling_seed": 8, "json_schema": json.dumps(schema)})
        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.time() + 60
        while eng.get_server_info()["num_running_reqs"] < 8 and time.time() < deadline:
            time.sleep(0.005)
        eng.pause_generation(mode="retract")
        time.sleep(0.05)
        eng.continue_generation()
        worker.join(120)
        assert eng.get_server_info()["stats"]["num_retractions"] > 0
        for text in _texts(result["outs"]):
            jsonschema.validate(json.loads(text), schema)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_refit_mid_grammar_keeps_outputs_valid(tiny_dir: str) -> None:
    """pause_generation(mode="in_place") mid-decode, a full refit to other weights (a tiny
    model of another seed, same shapes and tokenizer), continue: each grammar request keeps its
    own matcher across the weight change, its outputs validate, and its weight versions record
    both weights."""
    import threading
    import time

    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path

    other = str(tiny_model_path("qwen2", seed=7))
    schema = {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 60, "maxItems": 64}}, "required": ["xs"]}   # ~250 tokens
    eng = Engine(model_path=tiny_dir, scheduler_mode="thread", dtype="float32", device="cpu",
                 context_length=512, constrained_json_disable_any_whitespace=True)
    try:
        result: dict[str, Any] = {}

        def run() -> None:
            result["outs"] = eng.generate(prompt=["Answer in JSON:"] * 2, sampling_params={
                "max_new_tokens": 400, "n": 4, "temperature": 1.0, "sampling_seed": 3,
                "json_schema": json.dumps(schema)})
        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.time() + 60
        while eng.get_server_info()["num_running_reqs"] < 8 and time.time() < deadline:
            time.sleep(0.005)
        eng.pause_generation(mode="in_place")
        assert eng.get_server_info()["num_running_reqs"] == 8   # paused mid-decode, not done
        assert eng.update_weights_from_disk(other, weight_version="v2")[0]
        eng.continue_generation()
        worker.join(120)
        outs = result["outs"]
        for text in _texts(outs):
            jsonschema.validate(json.loads(text), schema)
        for o in outs:
            spans = o["meta_info"]["weight_versions"]
            assert [s["version"] for s in spans] == ["default", "v2"], o["meta_info"]
        eng.check_integrity()
    finally:
        eng.shutdown()
