"""Every bad input is a ValueError naming the field, nothing of the call runs, and the engine
keeps serving."""

from __future__ import annotations

import pytest

from rollout_engine import Engine

GOOD = {"temperature": 0, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def engine(qwen2_engine):
    return qwen2_engine


def sp(**fields) -> dict:
    return {"prompt": "hello", "sampling_params": {"max_new_tokens": 4, **fields}}


CASES = [
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty input_ids", {"input_ids": []}, "input_ids"),
    ("negative token id", {"input_ids": [5, -1, 7]}, "input_ids"),
    ("token id == vocab", {"input_ids": [5, 512]}, "input_ids"),
    ("token id >> vocab", {"input_ids": [10**9]}, "input_ids"),
    ("non-int token id", {"input_ids": [5, 6.0]}, "input_ids"),
    ("prompt + max_new_tokens > context", {"input_ids": [7] * 2000,
                                           "sampling_params": {"max_new_tokens": 49}},
     "max_new_tokens"),
    ("max_new_tokens > context", sp(max_new_tokens=4096), "max_new_tokens"),
    ("temperature < 0", sp(temperature=-0.5), "temperature"),
    ("temperature nan", sp(temperature=float("nan")), "temperature"),
    ("top_p 0", sp(top_p=0), "top_p"),
    ("top_p 1.5", sp(top_p=1.5), "top_p"),
    ("top_k 0", sp(top_k=0), "top_k"),
    ("top_k -2", sp(top_k=-2), "top_k"),
    ("min_p 2", sp(min_p=2.0), "min_p"),
    ("n 0", sp(n=0), "n"),
    ("max_new_tokens -1", sp(max_new_tokens=-1), "max_new_tokens"),
    ("min_new_tokens > max", sp(min_new_tokens=9), "min_new_tokens"),
    ("repetition_penalty 0", sp(repetition_penalty=0), "repetition_penalty"),
    ("unknown field", sp(tempreature=0.5), "tempreature"),
    ("temperature 'hot'", sp(temperature="hot"), "temperature"),
    ("max_new_tokens 1.5", sp(max_new_tokens=1.5), "max_new_tokens"),
    ("max_new_tokens True", sp(max_new_tokens=True), "max_new_tokens"),
    ("stop 3", sp(stop=3), "stop"),
    ("stop ['']", sp(stop=[""]), "stop"),
    ("ignore_eos 'yes'", sp(ignore_eos="yes"), "ignore_eos"),
    ("stop_token_ids out of vocab", sp(stop_token_ids=[512]), "stop_token_ids"),
    ("sampling_seed < 0", sp(sampling_seed=-1), "sampling_seed"),
    ("sampling_params not an object", {"prompt": "hi", "sampling_params": "greedy"},
     "sampling_params"),
    ("both prompt and input_ids", {"prompt": "hi", "input_ids": [5]}, "input_ids"),
    ("neither prompt nor input_ids", {"sampling_params": GOOD}, "prompt"),
    ("prompt not a string", {"prompt": 5}, "prompt"),
    ("return_logprob 'yes'", {"prompt": "hi", "return_logprob": "yes"}, "return_logprob"),
    ("top_logprobs_num -1", {"prompt": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
    ("logprob_start_len past prompt", {"input_ids": [5, 6], "logprob_start_len": 2},
     "logprob_start_len"),
    ("stream with n > 1", {**sp(n=2), "stream": True}, "stream"),
    ("rid not a string", {"prompt": "hi", "rid": 5}, "rid"),
    # batches: one bad item fails the whole call
    ("batch: one empty prompt", {"prompt": ["a", "b", ""], "sampling_params": GOOD}, "prompt"),
    ("batch: one bad token", {"input_ids": [[5, 6], [7], [512]], "sampling_params": GOOD},
     "input_ids"),
    ("batch: one bad sampling_params", {"prompt": ["a", "b"],
                                        "sampling_params": [GOOD, {**GOOD, "top_k": 0}]},
     "top_k"),
    ("batch: wrong number of sampling_params", {"prompt": ["a", "b"],
                                                "sampling_params": [GOOD]}, "sampling_params"),
    ("batch: duplicate rid", {"prompt": ["a", "b"], "sampling_params": GOOD,
                              "rid": ["same", "same"]}, "rid"),
]


def _served(engine) -> tuple[int, int]:
    stats = engine.get_server_info()["stats"]
    return stats["prompt_tokens"], stats["forward_passes"]


@pytest.mark.parametrize("kwargs,field", [(k, f) for _, k, f in CASES],
                         ids=[name for name, _, _ in CASES])
def test_bad_input_is_a_value_error_naming_the_field(engine, kwargs, field):
    before = _served(engine)
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    assert field in str(err.value), f"{err.value!s} does not name {field!r}"
    assert not engine.tm.states, "a rejected call left requests in flight"
    assert _served(engine) == before, "part of a rejected call ran"
    ok = engine.generate("hello", GOOD)
    assert len(ok["output_ids"]) == 2
    assert ok["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_bad_async_input_raises_too(engine):
    import asyncio

    with pytest.raises(ValueError, match="top_p"):
        asyncio.run(engine.async_generate("hi", {"top_p": 0}))
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=GOOD)["output_ids"]


def test_limits_that_just_fit_are_accepted(engine):
    context = engine.tm.context_len
    out = engine.generate(input_ids=[7] * (context - 3), sampling_params={"max_new_tokens": 3,
                                                                         "temperature": 0})
    assert len(out["output_ids"]) == 3
    out = engine.generate(input_ids=[0, engine.tm.vocab_size - 1], sampling_params=GOOD)
    assert len(out["output_ids"]) == 2


@pytest.mark.parametrize("flags,field", [
    ({"unknown_flag": 1}, "unknown_flag"),
    ({"page_size": "16"}, "page_size"),
    ({"max_running_requests": 1.5}, "max_running_requests"),
    ({"disable_radix_cache": "no"}, "disable_radix_cache"),
    ({"dtype": "int8"}, "dtype"),
    ({"scheduler_mode": "fiber"}, "scheduler_mode"),
    ({"page_size": 0}, "page_size"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_engine_flag_names_it(qwen2_path, flags, field):
    with pytest.raises(ValueError) as err:
        Engine(model_path=qwen2_path, **{"scheduler_mode": "thread", **flags})
    assert field in str(err.value)


def test_bad_model_path(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        Engine(model_path=str(tmp_path / "does-not-exist"), scheduler_mode="thread")
    with pytest.raises(ValueError, match="model_path"):
        Engine(model_path=str(tmp_path), scheduler_mode="thread")  # a directory, not a model
    with pytest.raises(ValueError, match="model_path"):
        Engine(scheduler_mode="thread")
