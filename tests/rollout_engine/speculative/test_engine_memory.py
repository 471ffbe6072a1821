"""Speculation and KV memory: radix reuse, retraction under a tiny pool, pages of rejected
proposals; plus the flags and the reported counters.

Engines run with ``debug_integrity`` (the KV invariant is proved whenever they go idle) and are
checked again at teardown. Outputs are compared with a plain engine's, token for token.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.config.speculative import SpecOptions
from rollout_engine.entrypoints.launch_server import parse_args
from rollout_engine.entrypoints.metrics import Metrics
from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import SPEC, repeated_prompts, run, spec_counts


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_radix_reuse_of_speculated_sequences_stays_exact(tiny_paths: dict[str, str]) -> None:
    path = tiny_paths["qwen3"]
    prompt = repeated_prompts(1, seed=5)[0]
    for plain in thread_engine(path, debug_integrity=True):
        first = run(plain, [prompt], greedy(32))[0]
        follow = prompt + first["output_ids"][:20]
        ref = run(plain, [follow, prompt], greedy(24))
    for spec in thread_engine(path, **SPEC, page_size=4):
        a = run(spec, [prompt], greedy(32))[0]
        b = run(spec, [follow, prompt], greedy(24))
    assert a["output_ids"] == first["output_ids"]
    assert [o["output_ids"] for o in b] == [o["output_ids"] for o in ref]
    # the continuation matches the first request's verified tokens, page-aligned: the tree
    # holds the prompt and the accepted output (never a rejected proposal's KV)
    assert b[0]["meta_info"]["cached_tokens"] >= (len(follow) - 1) // 4 * 4 - 4
    assert b[1]["meta_info"]["cached_tokens"] >= len(prompt) // 4 * 4 - 4
    assert spec_counts([a, *b])[1] > 0


def test_a_repeated_prompt_is_drafted_from_the_first_answer(tiny_paths: dict[str, str]) -> None:
    """The shared n-gram table: the second request for a prompt (a GRPO prompt's next round)
    gets the first answer as its proposals, all accepted under greedy; outputs unchanged."""
    path = tiny_paths["llama"]
    prompt = list(range(40, 70))        # nothing repeats in it
    for spec in thread_engine(path, **SPEC):
        first = run(spec, [prompt], greedy(30))[0]
        second = run(spec, [prompt], greedy(30))[0]
    assert second["output_ids"] == first["output_ids"]
    m = second["meta_info"]
    assert m["spec_accept_token_num"] == m["spec_draft_token_num"] >= 20
    assert m["spec_off_low_accept_ct"] == 0       # acceptance is high: never switched off
    assert m["spec_verify_ct"] <= 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_pool_stays_exact(tiny_paths: dict[str, str],
                                                  page_size: int) -> None:
    path = tiny_paths["qwen2"]
    prompts = repeated_prompts(6, seed=6)
    params = [greedy(44) if i % 2 else {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 44,
                                        "ignore_eos": True, "sampling_seed": i}
              for i in range(6)]
    for plain in thread_engine(path):
        ref = run(plain, prompts, params, return_logprob=True)
    for spec in thread_engine(path, **SPEC, page_size=page_size, max_total_tokens=160):
        got = run(spec, prompts, params, return_logprob=True)
        stats = spec.get_server_info()["stats"]
    assert stats["num_retractions"] > 0, "the pool was meant to force retractions"
    assert stats["spec_accepted_tokens"] > 0
    for x, y in zip(ref, got, strict=True):
        assert x["output_ids"] == y["output_ids"]
        lx = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
        ly = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4


def test_meta_info_and_prometheus_report_acceptance(tiny_paths: dict[str, str]) -> None:
    for spec in thread_engine(tiny_paths["qwen3"], **SPEC):
        outs = run(spec, repeated_prompts(2, seed=7), greedy(30))
        info = spec.get_server_info()
    for o in outs:
        m = o["meta_info"]
        hist = m["spec_accept_histogram"]
        assert sum(hist) == m["spec_verify_ct"] > 0
        assert sum(i * c for i, c in enumerate(hist)) == m["spec_accept_token_num"]
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"] / m["spec_verify_ct"])
        assert 0 < m["spec_accept_rate"] <= 1
        assert m["spec_accept_token_num"] <= m["spec_draft_token_num"]
    text = Metrics().render(info, alive=True)
    values = {name: float(value) for name, value in
              (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
    assert values["rollout_engine_spec_accepted_tokens_total"] == accepted
    assert values["rollout_engine_spec_off_steps_total"] == 0
    assert values["rollout_engine_spec_accept_length"] > 1
    assert info["speculative_algorithm"] == "NGRAM"           # get_server_info, SGLang's key
    assert info["speculative_num_draft_tokens"] == SPEC["speculative_num_draft_tokens"]


def test_flags_map_and_bad_values_name_the_field(qwen2_path: str) -> None:
    c = EngineConfig.from_kwargs(model_path=qwen2_path, speculative_algorithm="ngram",
                                 speculative_num_steps=3, speculative_eagle_topk=1,
                                 speculative_ngram_max_bfs_breadth=4)
    assert c.speculative_algorithm == "NGRAM"
    options = SpecOptions.from_config(c)
    assert options is not None and options.num_draft_tokens == 4       # steps + 1
    c = EngineConfig(model_path=qwen2_path, speculative_algorithm="NGRAM")
    assert SpecOptions.from_config(c).num_draft_tokens == 12   # SGLang: the max match window
    assert SpecOptions.from_config(EngineConfig(model_path=qwen2_path)) is None
    for kwargs, field in [({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
                          ({"speculative_num_draft_tokens": 1}, "speculative_num_draft_tokens"),
                          ({"speculative_eagle_topk": 4}, "speculative_eagle_topk"),
                          ({"speculative_ngram_min_match_window_size": 5,
                            "speculative_ngram_max_match_window_size": 2},
                           "speculative_ngram_max_match_window_size")]:
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(model_path=qwen2_path, **kwargs)
    kwargs = parse_args(["--model-path", qwen2_path, "--speculative-algorithm", "NGRAM",
                         "--speculative-num-draft-tokens", "6",
                         "--speculative-ngram-max-match-window-size", "8"])
    assert kwargs["speculative_algorithm"] == "NGRAM"
    assert kwargs["speculative_num_draft_tokens"] == 6
    assert kwargs["speculative_ngram_max_match_window_size"] == 8
