"""The GRPO examples, run for a few tiny steps: the loop completes; every step slept, woke and
refitted; the weight version advances every step and every rollout reports it; the engine's
logprobs equal the trainer's (on the rollouts, and on a probe right after each refit). The
same on a tiny Qwen3-MoE (--moe), and with rollout routing replay (--routing-replay): every
rollout's routing record is replayed in the trainer's re-scoring and in its loss forwards. With
--lora only the adapter is refitted each step."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

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


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    from grpo_common import ensure_model

    return ensure_model(tmp_path_factory.mktemp("grpo_moe") / "model", seed=0, moe=True)


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


@pytest.mark.slow   # 300 steps; bitwise on-policy: tests/trainer_bridge/test_on_policy.py
def test_grpo_colocated_tiny_on_policy(tmp_path, model_dir):
    """With --on-policy (a deterministic engine, the trainer's OnPolicyModel scorer) the
    rollout's logprobs equal the trainer's bit for bit at every step, across every refit."""
    import grpo_colocated

    summary = grpo_colocated.main([*_argv(tmp_path, model_dir), "--on-policy"])
    assert summary["transport"] == "tensor"
    _check_run(summary, tmp_path / "grpo_colocated.jsonl", 3)
    assert summary["on_policy"] is True
    assert summary["max_logprob_max_abs_diff"] == 0.0


def _adapter_bytes(model_dir: Path, rank: int) -> int:
    """fp32 bytes of a rank-``rank`` adapter on every projection of the model in
    ``model_dir``: A is [r, in] and B [out, r] for each projection of each layer."""
    c = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    in_out = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    return 4 * layers * rank * sum(i + o for i, o in in_out)


@pytest.mark.slow   # 300 GRPO steps; adapter sync and parity: tests/trainer_bridge and tests/rollout_engine/lora
def test_grpo_colocated_tiny_lora(tmp_path, model_dir):
    """--lora: the warm-started base is refitted once, then every step refits only the adapter
    (its bytes, nothing else), its version on the engine moves every step, the rollouts ask
    for it, and the engine's logprobs with the adapter equal the trainer's peft model's."""
    import grpo_colocated

    summary = grpo_colocated.main([*_argv(tmp_path, model_dir), "--lora", "--lora-rank", "4",
                                   "--lora-alpha", "8"])
    jsonl = tmp_path / "grpo_colocated.jsonl"
    _check_run(summary, jsonl, 3)
    assert summary["lora"] is True and summary["transport"] == "lora-tensor"
    adapter = _adapter_bytes(model_dir, 4)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()][:-1]
    assert [r["refit_bytes"] for r in rows] == [adapter] * 3
    assert summary["base_refit_bytes"] > 20 * adapter      # the base went once, at the start
    versions = [r["lora_version"] for r in rows]
    assert versions == sorted(set(versions)) and versions[0] > 1   # moves every step
    assert all(0 < r["adapter_refit_seconds"] <= r["refit_seconds"] for r in rows)
    # the trainer's updates reached the engine: the adapter changed the policy
    assert summary["eval_end_expected_accuracy"] != summary["eval_start_expected_accuracy"]


def test_lora_flags_refuse_what_they_cannot_combine(tmp_path, model_dir):
    import grpo_colocated

    with pytest.raises(ValueError, match="--lora: not combined with --moe"):
        grpo_colocated.parse_args([*_argv(tmp_path, model_dir), "--lora", "--on-policy"])
    with pytest.raises(ValueError, match="--lora-rank: must be at least 1"):
        grpo_colocated.parse_args([*_argv(tmp_path, model_dir), "--lora", "--lora-rank", "0"])


@pytest.mark.slow   # 3 GRPO steps; quantized parity and refits: tests/rollout_engine/quantization
def test_grpo_colocated_tiny_quantized_measures_its_mismatch(tmp_path, model_dir):
    """int8 rollouts against the float32 trainer: the run completes its refit checks and the
    rollout-vs-trainer mismatch it reports is the quantization's (not zero, under the bound)."""
    import grpo_colocated
    from grpo_common import QUANT_PROBE_TOL

    summary = grpo_colocated.main([*_argv(tmp_path, model_dir), "--quantization", "w8a8_int8"])
    assert summary["quantization"] == "w8a8_int8"
    assert summary["mean_logprob_abs_diff"] > TOL and summary["mean_kl_k3"] > 0   # quantized
    assert summary["max_probe_abs_diff"] <= QUANT_PROBE_TOL["w8a8_int8"]   # fake-quant trainer
    lines = [json.loads(line) for line in Path(summary["files"]["jsonl"]).read_text().splitlines()]
    rows = [r for r in lines if "step" in r]
    assert rows and all(r["probe_cached_after_refit"] == 0 for r in rows)   # no stale KV
    with pytest.raises(ValueError, match="--quantization: not combined with --lora"):
        grpo_colocated.parse_args([*_argv(tmp_path, model_dir), "--quantization", "fp8",
                                   "--lora"])


def test_grpo_server_tiny(tmp_path, model_dir):
    import grpo_server

    summary = grpo_server.main(_argv(tmp_path, model_dir))
    assert summary["transport"] == "distributed"
    _check_run(summary, tmp_path / "grpo_server.jsonl", 3)


def _spy_replays(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of the routing every `replay_routing` the examples enter is given."""
    import grpo_moe

    shapes: list[tuple[int, ...]] = []
    real = grpo_moe.replay_routing

    @contextmanager
    def spy(model: Any, routed_experts: torch.Tensor) -> Iterator[None]:
        shapes.append(tuple(routed_experts.shape))
        with real(model, routed_experts):
            yield

    monkeypatch.setattr(grpo_moe, "replay_routing", spy)
    return shapes


def test_grpo_colocated_tiny_moe_routing_replay(tmp_path, moe_model_dir, monkeypatch):
    """--moe --routing-replay: every rollout came with its routing record (the loop raises
    otherwise), the trainer's router alone agrees with it almost everywhere (the records line
    up with the tokens and layers), the re-scoring and each update replay it (the router
    still gets gradient), and the logprobs agree as in the dense runs."""
    import grpo_colocated

    replays = _spy_replays(monkeypatch)
    summary = grpo_colocated.main([*_argv(tmp_path, moe_model_dir), "--routing-replay"])
    jsonl = tmp_path / "grpo_colocated.jsonl"
    _check_run(summary, jsonl, 3)
    assert summary["model"]["arch"] == "qwen3_moe" and summary["model"]["num_experts"] == 8
    assert summary["routing_replay"] is True
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()][:-1]
    per_step = 4 * 4   # --tiny: 4 prompts x 4 samples
    for r in rows:
        assert r["routed_rollouts"] == per_step
        assert 0.0 <= r["routing_mismatch"] <= 0.05
        assert r["replayed_updates"] == r["updates"]
        assert r["router_grad_norm"] > 0 or r["updates"] == 0
    # one replay over the whole batch to re-score it, one per update (2 minibatches of 2 groups)
    layers, top_k = 2, 2
    assert [s[0] for s in replays].count(per_step) == 3
    assert [s[0] for s in replays].count(per_step // 2) == sum(r["updates"] for r in rows)
    assert all(len(s) == 4 and s[2:] == (layers, top_k) for s in replays)
    # the updates moved the policy the engine now serves
    assert summary["eval_end_expected_accuracy"] != summary["eval_start_expected_accuracy"]


@pytest.mark.slow   # the routing-replay run below trains the same MoE model in the default suite
def test_grpo_colocated_tiny_moe(tmp_path, moe_model_dir, monkeypatch):
    """--moe alone: the MoE model trains and refits like the dense one; nothing replays."""
    import grpo_colocated

    replays = _spy_replays(monkeypatch)
    summary = grpo_colocated.main([*_argv(tmp_path, moe_model_dir), "--moe", "--steps", "2"])
    jsonl = tmp_path / "grpo_colocated.jsonl"
    _check_run(summary, jsonl, 2)
    assert summary["model"]["arch"] == "qwen3_moe" and summary["routing_replay"] is False
    assert replays == []
    assert "routing_mismatch" not in json.loads(jsonl.read_text().splitlines()[0])


def test_ensure_model_never_reuses_dense_as_moe(tmp_path):
    from grpo_common import ensure_model

    model_dir = tmp_path / "model"

    def model_type() -> str:
        return json.loads((model_dir / "config.json").read_text())["model_type"]

    ensure_model(model_dir, seed=0)
    assert model_type() == "qwen2"
    ensure_model(model_dir, seed=0, moe=True)
    assert model_type() == "qwen3_moe"
    ensure_model(model_dir, seed=0)
    assert model_type() == "qwen2"


def test_train_step_replays_the_given_routing(moe_model_dir):
    """Records that send every token, in every layer, to the two experts layer 0 picks for
    <bos>: the re-scoring and the loss forward use exactly those (the other experts get no
    gradient), routing_mismatch counts where the router alone picks otherwise, and the
    logprobs differ from the router's own."""
    from grpo_common import AdditionTask, completion_logprobs, load_trainer_model, train_step
    from grpo_moe import own_routing
    from transformers import AutoTokenizer

    task = AdditionTask(AutoTokenizer.from_pretrained(str(moe_model_dir)))
    model = load_trainer_model(moe_model_dir)
    prompts = [task.prompts[i] for i in (3, 3, 47, 47)]
    completions = [task.answers[3], task.answers[5], task.answers[47], [task.eos]]
    with torch.no_grad(), own_routing(model) as chosen:
        own_lp, mask = completion_logprobs(model, prompts, completions, task.eos)
    rollout_lps = [own_lp[i, :len(c)].tolist() for i, c in enumerate(completions)]
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    pair = chosen[0][0].sort().values   # layer 0 at position 0 (<bos>): the same in every row
    experts = torch.zeros(8, dtype=torch.bool)
    experts[pair] = True
    records, differ, total = [], 0, 0
    for b, (p, c) in enumerate(zip(prompts, completions)):
        rows = len(p) + len(c) - 1
        records.append(pair.to(torch.int32).expand(rows, 2, 2).clone())
        for ids in chosen.values():
            own = ids.view(len(prompts), width, 2)[b, :rows].sort(-1).values
            differ += int((own != pair).any(-1).sum())
            total += rows
    assert 0 < differ < total

    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), prompts,
                       completions, rollout_lps, [1.0, 0.0, 0.0, 1.0], n=2, pad=task.eos,
                       clip=0.2, minibatches=1, routed_experts=records)
    assert stats["routing_mismatch"] == differ / total
    assert stats["logprob_abs_diff"] > 1e-3            # re-scored through experts {0, 1}
    assert stats["logprob_abs_diff_unreplayed"] < 1e-6  # the router's own choice: the rollout's
    assert stats["updates"] == stats["replayed_updates"] == 1
    assert stats["router_grad_norm"] > 0
    for layer in model.model.layers:
        for grad in (layer.mlp.experts.gate_up_proj.grad, layer.mlp.experts.down_proj.grad):
            assert bool((grad[experts].abs().sum((1, 2)) > 0).all())
            assert bool((grad[~experts] == 0).all())


@pytest.mark.slow
def test_grpo_colocated_moe_routing_replay_learns(tmp_path):
    """The full run (~3-4 minutes): the MoE policy, trained with routing replay, learns."""
    import grpo_colocated

    summary = grpo_colocated.main(["--routing-replay", "--out-dir", str(tmp_path),
                                   "--model-dir", str(tmp_path / "model"), "--max-minutes", "6",
                                   "--no-wandb", "--no-progress"])
    assert summary["max_probe_abs_diff"] <= TOL and summary["mean_logprob_abs_diff"] <= TOL
    # expected accuracy at T=1 over all 100 problems: the noise-free learning curve
    assert summary["eval_end_expected_accuracy"] >= summary["eval_start_expected_accuracy"] + 0.15
    assert summary["eval_end_accuracy"] > summary["eval_start_accuracy"]
