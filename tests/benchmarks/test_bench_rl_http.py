"""``benchmarks/bench_rl_http.py`` at a tiny size (our side only: server on both routes, then
the offline Engine), and the answer checks that keep it from timing errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import http_load  # noqa: E402

ROUTES = ["/generate", "/v1/completions"]


@pytest.mark.slow   # two process start-ups (server, Engine): ~20-30 s
def test_ours_at_a_tiny_size(tmp_path: Path, qwen2_path: str) -> None:
    out = tmp_path / "rl_http.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_rl_http.py"), "--sides", "ours",
         "--groups", "2", "--new-tokens", "4", "--prompt-len", "8", "--rounds", "1",
         "--skip-rates", "--model-dir", qwen2_path, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "cores" in lines[0]
    assert lines[-1].startswith("ours / vLLM at G=2: no pair measured")
    result = json.loads(out.read_text())
    assert result["benchmark"] == "bench_rl_http"
    work = result["workload"]
    assert (work["groups"], work["n"], work["new_tokens"], work["prompt_len"]) == ([2], 8, 4, 8)
    assert result["failed"] == {} and result["skipped"] == {}
    assert len(result["runs_by_round"]) == 1
    best = result["best_tok_s"]["ours"]
    assert sorted(best) == sorted(ROUTES + ["engine"])
    assert all(best[k]["2"] > 0 for k in best)
    ratios = result["server_over_engine"]["ours"]
    assert sorted(ratios) == sorted(ROUTES)
    for route in ROUTES:
        assert ratios[route]["2"] == pytest.approx(best[route]["2"] / best["engine"]["2"])
    assert result["ours_over_vllm"] == {}


def _generate_answer(n: int, new: int) -> list[dict]:
    return [{"output_ids": list(range(new)),
             "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in range(new)],
                           "finish_reason": {"type": "length", "length": new}}}
            for _ in range(n)]


def _completions_answer(n: int, new: int) -> dict:
    return {"choices": [{"index": i, "text": "x" * new, "finish_reason": "length",
                         "logprobs": {"tokens": ["x"] * new, "token_logprobs": [-0.5] * new}}
                        for i in range(n)],
            "usage": {"completion_tokens": n * new}}


def test_generate_check_refuses_short_or_missing_logprobs() -> None:
    http_load.check_generate(_generate_answer(8, 4), 8, 4, "ok")
    short = _generate_answer(8, 4)
    short[3]["output_ids"].pop()
    with pytest.raises(http_load.BadAnswer, match="sample 3: 3 output ids"):
        http_load.check_generate(short, 8, 4, "r")
    no_lp = _generate_answer(8, 4)
    no_lp[0]["meta_info"].pop("output_token_logprobs")
    with pytest.raises(http_load.BadAnswer, match="0 token logprobs"):
        http_load.check_generate(no_lp, 8, 4, "r")
    nan = _generate_answer(8, 4)
    nan[1]["meta_info"]["output_token_logprobs"][2][0] = float("nan")
    with pytest.raises(http_load.BadAnswer, match="sample 1 token 2"):
        http_load.check_generate(nan, 8, 4, "r")
    with pytest.raises(http_load.BadAnswer, match="a list of 8 samples"):
        http_load.check_generate(_generate_answer(7, 4), 8, 4, "r")


def test_completions_check_refuses_wrong_counts() -> None:
    http_load.check_completions(_completions_answer(8, 4), 8, 4, "ok")
    with pytest.raises(http_load.BadAnswer, match="expected 8 choices"):
        http_load.check_completions(_completions_answer(7, 4), 8, 4, "r")
    missing = _completions_answer(8, 4)
    missing["choices"][5]["logprobs"] = None
    with pytest.raises(http_load.BadAnswer, match="choice 5: 0 tokens"):
        http_load.check_completions(missing, 8, 4, "r")
    null_lp = _completions_answer(8, 4)
    null_lp["choices"][0]["logprobs"]["token_logprobs"][1] = None
    with pytest.raises(http_load.BadAnswer, match="choice 0: token_logprobs"):
        http_load.check_completions(null_lp, 8, 4, "r")
    usage = _completions_answer(8, 4)
    usage["usage"]["completion_tokens"] = 31
    with pytest.raises(http_load.BadAnswer, match="usage.completion_tokens 31"):
        http_load.check_completions(usage, 8, 4, "r")
