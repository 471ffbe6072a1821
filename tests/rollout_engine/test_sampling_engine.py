"""Sampling through the Engine on the tiny Qwen2: seeds, n, stop conditions, streaming, abort,
and UTF-8-safe detokenization."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time

import pytest
from transformers import AutoTokenizer

from rollout_engine.detokenizer import IncrementalDetokenizer

SEEDED = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 12,
          "sampling_seed": 1234}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(qwen2_engine):
    return qwen2_engine


def greedy(engine, prompt: str, n: int = 16, **extra) -> dict:
    return engine.generate(prompt, {"temperature": 0, "max_new_tokens": n, **extra})


def others(vocab: int, k: int = 8) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(0)
    ids = [[rng.randrange(5, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(k)]
    sps = [{"temperature": rng.choice([0, 0.7, 1.3]), "top_k": rng.choice([-1, 5, 100]),
            "min_p": rng.choice([0.0, 0.05]), "max_new_tokens": rng.randrange(4, 16),
            "sampling_seed": rng.randrange(1 << 40)} for _ in range(k)]
    return ids, sps


def test_seed_reproduces_across_runs_and_batch_compositions(engine, make_engine, qwen2_path):
    first = engine.generate(PROMPT, SEEDED, return_logprob=True)
    ids = first["output_ids"]
    assert len(ids) == 12
    assert engine.generate(PROMPT, SEEDED)["output_ids"] == ids
    # inside one batch of 8 other random requests with other seeds and parameters
    other_ids, other_sps = others(engine.tm.vocab_size)
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    batch = engine.generate(input_ids=other_ids[:4] + [prompt_ids] + other_ids[4:],
                            sampling_params=other_sps[:4] + [SEEDED] + other_sps[4:],
                            return_logprob=True)
    assert batch[4]["output_ids"] == ids
    lps = [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]]
    batch_lps = [lp for lp, _, _ in batch[4]["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lps, batch_lps)) < 1e-4
    # joining a batch that is already decoding: a long blocker runs throughout
    blocker = threading.Thread(target=engine.generate, kwargs={
        "input_ids": other_ids[0], "rid": "blocker",
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
    blocker.start()
    deadline = time.monotonic() + 30
    while engine.get_server_info()["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the blocker never started"
        time.sleep(0.005)
    assert engine.generate(PROMPT, SEEDED)["output_ids"] == ids
    assert blocker.is_alive()   # it was decoding alongside the whole time
    engine.abort_request("blocker")
    blocker.join()
    # one request at a time
    alone = make_engine(qwen2_path, max_running_requests=1)
    assert alone.generate(PROMPT, SEEDED)["output_ids"] == ids
    # and the seed matters
    assert engine.generate(PROMPT, {**SEEDED, "sampling_seed": 99})["output_ids"] != ids


def test_parallel_samples_are_seeded_and_differ(engine):
    outs = engine.generate(PROMPT, {**SEEDED, "n": 4})
    assert isinstance(outs, list) and len(outs) == 4
    samples = [o["output_ids"] for o in outs]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) >= 2
    assert [o["output_ids"] for o in engine.generate(PROMPT, {**SEEDED, "n": 4})] == samples
    assert len({o["meta_info"]["id"] for o in outs}) == 4


def _printable_stop(text: str) -> str:
    """A two-character piece first seen in the middle of ``text``, free of replacement
    characters and outer spaces."""
    for i in range(len(text) // 3, len(text) - 2):
        piece = text[i:i + 2]
        if "\ufffd" not in piece and piece.strip() == piece and text.find(piece) == i:
            return piece
    pytest.skip("no printable text to stop on")


def test_stop_string_is_trimmed(engine):
    full = greedy(engine, PROMPT)
    stop = _printable_stop(full["text"])
    out = greedy(engine, PROMPT, stop=["never-there", stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][:full["text"].find(stop)]
    ids = out["output_ids"]
    assert ids == full["output_ids"][:len(ids)]
    decode = engine.tokenizer.decode
    assert stop in decode(ids) and stop not in decode(ids[:-1])  # stopped on the first hit


def test_stop_token_ids_and_min_new_tokens(engine):
    full = greedy(engine, PROMPT)["output_ids"]
    k = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    tok = full[k]
    out = greedy(engine, PROMPT, stop_token_ids=[tok])
    assert out["output_ids"] == full[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    # the matched stop token stays in output_ids but not in the text (as in SGLang)
    assert out["text"] == engine.tokenizer.decode(full[:k])
    # min_new_tokens bans the stop token until k + 2 tokens exist; logprobs show it was top-1
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16,
                                   "stop_token_ids": [tok], "min_new_tokens": k + 2},
                          return_logprob=True, top_logprobs_num=1)
    ids = out["output_ids"]
    assert ids[:k] == full[:k] and tok not in ids[:k + 2]
    assert out["meta_info"]["output_top_logprobs"][k][0][1] == tok
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert ids[-1] == tok and len(ids) > k + 2
    else:
        assert len(ids) == 16


def test_eos_ignore_eos_and_min_new_tokens(engine, make_engine, qwen2_path, tmp_path):
    """A copy of the model whose EOS is a token greedy decoding emits."""
    full = greedy(engine, PROMPT)["output_ids"]
    k = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    model = tmp_path / "model"
    shutil.copytree(qwen2_path, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": full[k]}))
    eng = make_engine(str(model))
    out = greedy(eng, PROMPT)
    assert out["output_ids"] == full[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}
    assert out["text"] == eng.tokenizer.decode(full[:k])  # EOS is not part of the text
    out = greedy(eng, PROMPT, ignore_eos=True)
    assert out["output_ids"] == full
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    out = greedy(eng, PROMPT, min_new_tokens=k + 3)
    assert full[k] not in out["output_ids"][:k + 3] and len(out["output_ids"]) > k + 3


def test_max_new_tokens_zero(engine):
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0)
    assert out["text"] == "" and out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(prompt)
    assert meta["output_token_logprobs"] == []
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt and got[0][0] is None
    ref = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=0)["meta_info"]
    want = ref["input_token_logprobs"]
    assert max(abs(a[0] - b[0]) for a, b in zip(got[1:], want[1:])) < 1e-5
    assert engine.generate(PROMPT, {"max_new_tokens": 0})["output_ids"] == []


@pytest.mark.parametrize("stop", [None, "stop-string"])
def test_streaming_matches_non_streaming(engine, stop):
    sp = {**SEEDED, "max_new_tokens": 16}
    if stop is not None:
        sp["stop"] = [_printable_stop(engine.generate(PROMPT, sp)["text"])]
    whole = engine.generate(PROMPT, sp)
    chunks = list(engine.generate(PROMPT, sp, stream=True))   # cumulative, as SGLang streams
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])

    async def run() -> tuple[list[dict], dict]:
        stream = await engine.async_generate(PROMPT, sp, stream=True)
        return [c async for c in stream], await engine.async_generate(PROMPT, sp)

    achunks, aout = asyncio.run(run())
    assert achunks[-1]["text"] == whole["text"]
    assert achunks[-1]["output_ids"] == whole["output_ids"]
    assert aout["output_ids"] == whole["output_ids"] and aout["text"] == whole["text"]
    assert aout["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_abort_returns_partial_output_and_engine_keeps_serving(engine):
    long = {"temperature": 1.0, "max_new_tokens": 1500, "ignore_eos": True, "sampling_seed": 3}
    chunks = []
    for chunk in engine.generate(PROMPT, long, stream=True, rid="stream-long"):
        chunks.append(chunk)
        if len(chunks) == 3:
            engine.abort_request("stream-long")
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(chunks[-1]["output_ids"]) < 1500   # cumulative chunks
    # non-streaming: the final answer carries what was generated before the abort
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(
        out=engine.generate(PROMPT, long, rid="plain-long")))
    before = engine.get_server_info()["stats"]["decode_tokens"]
    worker.start()
    deadline = time.time() + 30
    while engine.get_server_info()["stats"]["decode_tokens"] < before + 5:
        assert time.time() < deadline, "the long request never started decoding"
        time.sleep(0.01)
    engine.abort_request("plain-long")
    worker.join(30)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(out["output_ids"])
    assert 0 < n < 1500 and out["meta_info"]["completion_tokens"] == n
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])
    # the stream prefix is the seeded sequence: the engine still serves the same tokens
    again = engine.generate(PROMPT, {**long, "max_new_tokens": 3})
    assert again["output_ids"] == chunks[-1]["output_ids"][:3]
    engine.check_integrity()


TEXTS = ["Hello 世界! 🎉🚀 naïve café — 日本語のテキスト 👩‍👩‍👧 end",
         "emoji only: 😀😃😄😁 and CJK 中文字符测试。", "mixed: Ωμέγα Ελληνικά 🇯🇵 한국어"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_is_utf8_safe(qwen2_path, text):
    tok = AutoTokenizer.from_pretrained(qwen2_path)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    rng = random.Random(len(text))
    for group in (1, 2, None):  # one token at a time, pairs, random sizes
        detok = IncrementalDetokenizer(tok)
        deltas, i = [], 0
        while i < len(ids):
            step = group or rng.randrange(1, 4)
            deltas.append(detok.push(ids[i:i + step], finished=i + step >= len(ids)))
            i += step
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
    # a multi-byte stop string is trimmed, and nothing past it leaks out
    stop = text[len(text) // 2]
    detok = IncrementalDetokenizer(tok, stop=[stop])
    deltas = [detok.push([t], finished=j == len(ids) - 1) for j, t in enumerate(ids)]
    assert "".join(deltas) == text[:text.find(stop)] == detok.full_text()
