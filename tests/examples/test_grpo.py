"""The GRPO examples, run for a few tiny steps: the loop completes; every step slept, woke and
refitted; the weight version advances every step and every rollout reports it; the engine's
logprobs equal the trainer's (on the rollouts, and on a probe right after each refit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rl"
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def examples_on_path():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("grpo") / "model"


def _argv(out_dir: Path, model_dir: Path) -> list[str]:
    # a short warm-start so completions are well-formed and rewards differ within groups:
    # the trainer really updates and every refit carries new weights
    return ["--tiny", "--warm-start-target", "0.1", "--out-dir", str(out_dir),
            "--model-dir", str(model_dir), "--max-minutes", "3"]


def _check_run(summary: dict, jsonl: Path, steps: int) -> None:
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [r for r in lines if "step" in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert "summary" in lines[-1]
    for r in rows:
        # every rollout of step k ran at version k (the loop raises otherwise) ...
        assert r["weight_version"] == str(r["step"])
        # ... and the step slept (memory freed), woke and refitted to version k + 1
        assert r["new_weight_version"] == str(r["step"] + 1)
        assert r["bytes_freed"] > 0 and r["refit_bytes"] > 0
        assert r["sleep_seconds"] > 0 and r["wake_seconds"] > 0 and r["refit_seconds"] > 0
        # rollout logprobs vs the trainer's re-scoring, before its update
        assert r["logprob_abs_diff"] <= TOL and r["kl_k3"] <= TOL
        # right after the refit: same logprobs on the probe; no KV from the old weights
        assert r["probe_abs_diff"] <= TOL
        assert r["probe_cached_after_refit"] == 0 and r["probe_cached_second"] > 0
        assert r["prompt_tokens"] > 0 and 0 <= r["kv_hit_rate"] <= 1
    assert sum(r["updates"] for r in rows) > 0, "the trainer never updated: refits were no-ops"
    assert summary["max_probe_abs_diff"] <= TOL
    assert summary["initial_probe_abs_diff"] <= TOL
    assert Path(summary["files"]["plot"]).stat().st_size > 0


def test_grpo_colocated_tiny_on_policy(tmp_path, model_dir):
    """With --on-policy (a deterministic engine, the trainer's OnPolicyModel scorer) the
    rollout's logprobs equal the trainer's bit for bit at every step, across every refit."""
    import grpo_colocated

    summary = grpo_colocated.main([*_argv(tmp_path, model_dir), "--on-policy"])
    assert summary["transport"] == "tensor"
    _check_run(summary, tmp_path / "grpo_colocated.jsonl", 3)
    assert summary["on_policy"] is True
    assert summary["max_logprob_max_abs_diff"] == 0.0


def test_grpo_server_tiny(tmp_path, model_dir):
    import grpo_server

    summary = grpo_server.main(_argv(tmp_path, model_dir))
    assert summary["transport"] == "distributed"
    _check_run(summary, tmp_path / "grpo_server.jsonl", 3)
