"""Streaming and aborts with speculation: a verify step appends several tokens at once."""

from __future__ import annotations

from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import SPEC, repeated_prompts


def test_streamed_chunks_add_up_to_the_plain_output(qwen2_path: str) -> None:
    prompt = repeated_prompts(1, seed=12)[0]
    params = {"temperature": 0, "max_new_tokens": 36, "ignore_eos": True}
    for plain in thread_engine(qwen2_path):
        ref = plain.generate(input_ids=prompt, sampling_params=params)
    for spec in thread_engine(qwen2_path, **SPEC, incremental_streaming_output=True):
        chunks = list(spec.generate(input_ids=prompt, sampling_params=params, stream=True))
    ids = [t for c in chunks for t in c["output_ids"]]
    assert ids == ref["output_ids"]
    assert "".join(c["text"] for c in chunks) == ref["text"]
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "length"
    # fewer chunks than tokens: verify steps that accepted proposals sent several at once
    assert len(chunks) < len(ids) and last["spec_accept_token_num"] > 0


def test_abort_in_the_middle_frees_every_page(qwen2_path: str) -> None:
    prompts = repeated_prompts(3, seed=13)
    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    for spec in thread_engine(qwen2_path, **SPEC):
        stream = spec.generate(input_ids=prompts[0], sampling_params=params, stream=True)
        got = 0
        for _chunk in stream:
            got += 1
            if got == 3:
                break
        stream.close()          # closing the stream aborts the request mid-decode
        out = spec.generate(input_ids=prompts[1:], sampling_params={**params,
                                                                    "max_new_tokens": 20})
        report = spec.check_integrity()
    assert [len(o["output_ids"]) for o in out] == [20, 20]
    assert report["owned_tokens"] == 0
