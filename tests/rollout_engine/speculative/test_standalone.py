"""STANDALONE speculation: a draft model proposes, the target decides; outputs stay exact.

The draft is the target itself (greedy proposals are then always accepted: the strongest check
that the draft's KV at the target's slots is right, since one stale K/V row makes the draft
disagree) or a tiny model with other weights (most proposals rejected). Either way outputs and
logprobs must equal the plain engine's; under a tiny pool, retractions and radix hits included.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_engine.config import EngineConfig
from rollout_engine.testing.tiny_model import tiny_model_path
from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import repeated_prompts, run, spec_counts


def standalone(draft: str, **flags: Any) -> dict[str, Any]:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
            "speculative_num_steps": 3, "debug_integrity": True, **flags}


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        lx = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
        ly = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4


PARAMS = [{"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
          {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30, "ignore_eos": True,
           "sampling_seed": 11},
          {"temperature": 0, "max_new_tokens": 21, "ignore_eos": True}]


@pytest.mark.parametrize("draft", ["self", "other"])
def test_outputs_equal_the_plain_engine(qwen2_path: str, draft: str) -> None:
    draft_path = qwen2_path if draft == "self" else str(tiny_model_path("qwen2", seed=1))
    prompts = repeated_prompts(3, seed=8)
    for plain in thread_engine(qwen2_path):
        ref = run(plain, prompts, PARAMS, return_logprob=True)
    for spec in thread_engine(qwen2_path, **standalone(draft_path)):
        got = run(spec, prompts, PARAMS, return_logprob=True)
        again = run(spec, prompts[:1], PARAMS[:1], return_logprob=True)   # a radix hit
    assert_same(ref, got)
    assert_same(ref[:1], again)
    assert again[0]["meta_info"]["cached_tokens"] > 0
    verify_ct, accepted = spec_counts(got)
    assert verify_ct > 0
    greedy_rows = [got[0], got[2]]
    rate = sum(o["meta_info"]["spec_accept_token_num"] for o in greedy_rows) / sum(
        o["meta_info"]["spec_draft_token_num"] for o in greedy_rows)
    if draft == "self":
        assert rate == 1.0      # the target drafting for itself: every greedy proposal holds
        assert all(o["meta_info"]["spec_off_low_accept_ct"] == 0 for o in greedy_rows)
        # and after a radix hit: the draft's KV at the cached slots is right too
        m = again[0]["meta_info"]
        assert m["spec_accept_token_num"] == m["spec_draft_token_num"] > 0
    else:
        assert rate < 0.5


def test_retraction_under_a_tiny_pool_with_a_draft(qwen2_path: str) -> None:
    prompts = repeated_prompts(6, seed=9)
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}] * 6
    for plain in thread_engine(qwen2_path):
        ref = run(plain, prompts, params, return_logprob=True)
    for spec in thread_engine(qwen2_path, **standalone(qwen2_path, page_size=4,
                                                      max_total_tokens=160)):
        got = run(spec, prompts, params, return_logprob=True)
        stats = spec.get_server_info()["stats"]
    assert stats["num_retractions"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert_same(ref, got)


def test_standalone_flags(qwen2_path: str) -> None:
    with pytest.raises(ValueError, match="EngineConfig.speculative_draft_model_path"):
        EngineConfig(model_path=qwen2_path, speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="EngineConfig.speculative_draft_model_path"):
        EngineConfig(model_path=qwen2_path, speculative_draft_model_path=qwen2_path)
    c = EngineConfig.from_kwargs(model_path=qwen2_path, speculative_algorithm="STANDALONE",
                                 speculative_draft_model_path=qwen2_path)
    from rollout_engine.config.speculative import SpecOptions
    assert SpecOptions.from_config(c).num_draft_tokens == 4     # 3 steps + the last token


def test_standalone_with_the_hierarchical_cache_is_refused(qwen2_path: str) -> None:
    """Its host and storage tiers keep the target's KV only: a prefix loaded back from them
    would leave the draft drafting from stale KV."""
    both = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": qwen2_path,
            "enable_hierarchical_cache": True}
    with pytest.raises(ValueError, match="EngineConfig.speculative_algorithm") as e:
        EngineConfig(model_path=qwen2_path, **both)
    assert "enable_hierarchical_cache" in str(e.value)
    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        EngineConfig.from_kwargs(model_path=qwen2_path, **both)
    # each alone, and NGRAM with the cache, stay allowed
    EngineConfig(model_path=qwen2_path, **{**both, "enable_hierarchical_cache": False})
    EngineConfig(model_path=qwen2_path, enable_hierarchical_cache=True,
                 speculative_algorithm="NGRAM")


def test_the_launch_flags_refuse_standalone_with_the_hierarchical_cache(
        qwen2_path: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_engine.entrypoints import http_server
    from rollout_engine.entrypoints.launch_server import main

    started: list[Any] = []
    monkeypatch.setattr(http_server, "run_server", lambda kwargs: started.append(kwargs) or 0)
    code = main(["--model-path", qwen2_path, "--speculative-algorithm", "STANDALONE",
                 "--speculative-draft-model-path", qwen2_path, "--enable-hicache"])
    err = capsys.readouterr().err
    assert code == 2 and not started
    assert "STANDALONE" in err and "enable_hierarchical_cache" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("backup", [True, False])
def test_sleep_and_wake_take_the_draft_along(qwen2_path: str, backup: bool) -> None:
    """Sleep frees the draft's weights and KV with the target's; after a wake (and, without a
    CPU backup, a disk refit of the target) outputs equal the plain engine's and the
    self-draft still agrees on every greedy proposal: its weights came back (reloaded from its
    checkpoint when there was no backup)."""
    prompts = repeated_prompts(2, seed=10)
    params = PARAMS[:1] * 2
    for plain in thread_engine(qwen2_path):
        ref = run(plain, prompts, params, return_logprob=True)
    for spec in thread_engine(qwen2_path, **standalone(qwen2_path),
                              enable_weights_cpu_backup=backup):
        spec.release_memory_occupation()
        assert set(spec.get_server_info()["released_memory"]) >= {"weights", "kv_cache"}
        spec.resume_memory_occupation()
        if not backup:
            spec.update_weights_from_disk(qwen2_path)
        got = run(spec, prompts, params, return_logprob=True)
    assert_same(ref, got)
    assert all(o["meta_info"]["spec_accept_token_num"] == o["meta_info"]["spec_draft_token_num"]
               > 0 for o in got)


def test_a_batch_above_the_switch_off_skips_the_draft_and_catches_up(qwen2_path: str) -> None:
    """Above speculative_max_batch_size the draft's forward is skipped; once the batch shrinks
    (and before a finished request's KV enters the radix tree) the draft computes the missing
    positions in one EXTEND. The self-draft agreeing on every greedy proposal afterwards, and
    after a radix hit, shows its KV was made whole."""
    prompts = repeated_prompts(5, seed=12)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
              for n in (12, 18, 26, 34, 40)]
    for plain in thread_engine(qwen2_path):
        ref = run(plain, prompts, params, return_logprob=True)
        follow = prompts[4] + ref[4]["output_ids"][:30]   # decoded while the draft was off
        ref_again = run(plain, [follow], params[:1], return_logprob=True)
    for spec in thread_engine(qwen2_path, **standalone(qwen2_path),
                              speculative_max_batch_size=2):
        got = run(spec, prompts, params, return_logprob=True)
        again = run(spec, [follow], params[:1], return_logprob=True)   # a radix hit
        stats = spec.get_server_info()["stats"]
    assert_same(ref, got)
    assert_same(ref_again, again)
    assert stats["spec_off_steps"] > 0 and stats["spec_draft_catch_up_tokens"] > 0
    for o in [*got[3:], *again]:      # these speculated once the batch was down to two
        m = o["meta_info"]
        assert m["spec_accept_token_num"] == m["spec_draft_token_num"] > 0
    assert again[0]["meta_info"]["cached_tokens"] >= len(follow) - 1
