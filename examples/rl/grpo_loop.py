"""The GRPO loop both examples run, against anything with the Engine's methods: an in-process
`rollout_engine.Engine` (colocated) or a `trainer_bridge.RolloutClient` (server).

Each step: rollout (n samples per prompt, logprobs, weight versions) -> reward -> the engine
sleeps (weights + KV released) while the trainer re-scores the rollout and updates -> the
engine wakes and is refitted through a `WeightSyncer` (new weight version) -> checks: no KV
survives the refit, and the engine's logprobs on a fixed probe equal the trainer's. With
--lora the trainer trains an adapter and only the adapter is refitted (grpo_lora.py).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_common import (  # noqa: E402
    LOGPROB_TOL,
    MAX_NEW_TOKENS,
    PARTIAL_CREDIT,
    QUANT_PROBE_TOL,
    AdditionTask,
    ensure_model,
    expected_accuracy,
    load_trainer_model,
    model_spec,
    probe_delta,
    probe_logprobs,
    train_step,
    warm_start,
)
from grpo_logging import RunLogger, asdict_files, summarize  # noqa: E402
from grpo_lora import LORA_NAME, SLEEP_TAGS, adapter_version, wrap_with_lora  # noqa: E402
from grpo_moe import decode_records  # noqa: E402

from trainer_bridge import engine_sleeping  # noqa: E402
from trainer_bridge.client import to_rollouts  # noqa: E402
from trainer_bridge.quantized_reference import fake_quantized  # noqa: E402


class RefitCheckError(AssertionError):
    """The engine disagrees with the trainer after a refit (logprobs, version or stale KV)."""


def add_common_args(p: argparse.ArgumentParser, out_dir: str) -> None:
    p.add_argument("--steps", type=int, default=300, help="GRPO steps (upper bound)")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--lr", type=float, default=None,
                   help="the trainer's learning rate (default 1e-4; with --lora 1e-3)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon")
    p.add_argument("--entropy-coef", type=float, default=0.0,
                   help="entropy bonus (keeps the policy from collapsing onto wrong answers)")
    p.add_argument("--no-std-norm", action="store_true",
                   help="advantages r - group mean, not divided by the group std (Dr. GRPO)")
    p.add_argument("--minibatches", type=int, default=2,
                   help="optimizer steps per rollout batch (later ones are off-policy: the "
                        "importance ratio and clipping matter)")
    p.add_argument("--partial-credit", type=float, default=PARTIAL_CREDIT,
                   help="reward share of a wrong answer, times its fraction of right positions")
    p.add_argument("--warm-start-target", type=float, default=0.2,
                   help="stop the supervised warm-start at this expected accuracy")
    p.add_argument("--warm-start-lr", type=float, default=2e-4,
                   help="small: the warm-start spreads probability over answers (exploration)")
    p.add_argument("--out-dir", default=out_dir)
    p.add_argument("--model-dir", default=None,
                   help="the tiny model directory, built if missing (default: "
                        "runs/grpo_model, with --moe runs/grpo_moe_model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=9.0,
                   help="stop after this much wall time (setup included)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer and of the engine (1 is fastest on a "
                        "busy 2-core machine)")
    p.add_argument("--no-wandb", action="store_true", help="JSONL and PNG only")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--on-policy", action="store_true",
                   help="the engine with enable_deterministic_inference, and the mismatch "
                        "scored by trainer_bridge.on_policy.OnPolicyModel: exactly 0")
    p.add_argument("--moe", action="store_true",
                   help="train a tiny Qwen3-MoE (8 experts, top-2) instead of the dense qwen2")
    p.add_argument("--routing-replay", action="store_true",
                   help="rollout routing replay (R3; implies --moe): the engine returns the "
                        "experts of every rollout token, and the trainer's forwards over "
                        "them route by that record")
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter on the frozen warm-started base; each step "
                        "refits only the adapter (grpo_lora.py)")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapter's rank r")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="the adapter's lora_alpha (scale alpha / r)")
    p.add_argument("--quantization", choices=["w8a8_int8", "fp8"], default=None,
                   help="quantized rollouts: the engine serves int8 / fp8 weights, quantized "
                        "from the trainer's float32 tensors at every refit; the printed "
                        "rollout-vs-trainer mismatch is what that costs")
    p.add_argument("--tiny", action="store_true",
                   help="CI settings: at most 3 steps, 4 prompts x 4 samples, no wandb, no bar")


def resolve_args(args: argparse.Namespace) -> None:
    """What the flags imply: --tiny's CI settings, --routing-replay's --moe, the model dir,
    the learning rate; --lora with --moe or --on-policy is refused (ValueError)."""
    if args.lora and (args.moe or args.routing_replay or args.on_policy):
        raise ValueError("--lora: not combined with --moe, --routing-replay or --on-policy "
                         "(the on-policy scorer and the routing replay score the full model)")
    if getattr(args, "quantization", None) and (args.lora or args.moe or args.routing_replay
                                                or args.on_policy):
        raise ValueError("--quantization: not combined with --lora, --moe, --routing-replay "
                         "or --on-policy (a quantized engine cannot equal the float32 trainer)")
    if args.lora and args.lora_rank < 1:
        raise ValueError(f"--lora-rank: must be at least 1, got {args.lora_rank}")
    if args.lr is None:
        args.lr = 1e-3 if args.lora else 1e-4
    if args.tiny:
        args.steps, args.prompts_per_step, args.n = min(args.steps, 3), 4, 4
        args.no_wandb, args.no_progress = True, True
    if args.routing_replay:
        args.moe = True
    if args.model_dir is None:
        args.model_dir = "runs/grpo_moe_model" if args.moe else "runs/grpo_model"


class Trainer:
    """The trainer's half: the HF model (float32, same directory), task, optimizer."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        self.model_dir = ensure_model(Path(args.model_dir), args.seed, args.moe)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.task = AdditionTask(self.tokenizer, args.partial_credit)
        self.model = load_trainer_model(self.model_dir)
        self.warm = warm_start(self.model, self.task, args.warm_start_target,
                               args.warm_start_lr, max_seconds=60.0, seed=args.seed)
        # --lora: the warm-started weights are the frozen base (refitted once, by these
        # tensors), and the adapter the policy; its name is what rollouts ask for
        self.lora_name: Optional[str] = None
        # quantized rollouts: the probe after a refit is held to the quantization's error
        self.quantization: Optional[str] = getattr(args, "quantization", None)
        self.base_weights = [(n, p.detach()) for n, p in
                             self.model.named_parameters(remove_duplicate=False)]
        if getattr(args, "lora", False):
            self.model = wrap_with_lora(self.model, args.lora_rank, args.lora_alpha)
            self.lora_name = LORA_NAME
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=args.lr, weight_decay=0.0)
        self.scorer = None
        if getattr(args, "on_policy", False):
            from trainer_bridge.on_policy import OnPolicyModel

            self.scorer = OnPolicyModel(str(self.model_dir))


def policy(trainer: Trainer) -> dict[str, Any]:
    """The generate keywords that ask for the trainer's policy (its adapter with --lora)."""
    return {} if trainer.lora_name is None else {"lora_path": trainer.lora_name}


def check_after_refit(engine: Any, trainer: Trainer, version: str) -> dict[str, Any]:
    """Right after a refit: the engine reports `version`; a prompt it had cached under the old
    weights gets no cache hit (and does the second time: the cache works); the engine's
    logprobs on the probe equal the trainer's within LOGPROB_TOL (a quantized engine: the
    trainer's model fake-quantized the same way, within QUANT_PROBE_TOL). Raises
    RefitCheckError.
    With --lora the probes ask for the adapter, and the result carries its version."""
    probe = trainer.task.probe
    got = engine.get_weight_version()
    if got != version:
        raise RefitCheckError(f"engine reports weight_version {got!r}, expected {version!r}")
    plain = {"max_new_tokens": 1, "temperature": 0.0}
    first = engine.generate(input_ids=probe, sampling_params=plain, **policy(trainer))[
        "meta_info"]
    out = engine.generate(input_ids=probe, sampling_params={"max_new_tokens": 1,
                                                            "temperature": 1.0},
                          return_logprob=True, logprob_start_len=0, **policy(trainer))
    second = engine.generate(input_ids=probe, sampling_params=plain, **policy(trainer))[
        "meta_info"]
    # a quantized engine is held to the trainer's model quantized the same way
    scorer = trainer.model if trainer.quantization is None else fake_quantized(
        trainer.model, trainer.quantization)
    delta = probe_delta(out, probe_logprobs(scorer, probe))
    if first["cached_tokens"] != 0:
        raise RefitCheckError(f"stale KV: the probe hit {first['cached_tokens']} cached tokens "
                              f"right after the refit to {version!r}")
    if second["cached_tokens"] == 0:
        raise RefitCheckError("the radix cache never hits: the stale-KV check proves nothing")
    for meta in (first, out["meta_info"], second):
        if meta["weight_version"] != version:
            raise RefitCheckError(f"a probe ran at {meta['weight_version']!r}, not {version!r}")
    tol = LOGPROB_TOL if trainer.quantization is None else QUANT_PROBE_TOL[trainer.quantization]
    if not delta <= tol:
        raise RefitCheckError(f"engine vs trainer logprobs on the probe after the refit to "
                              f"{version!r}: mean |delta| {delta:.3g} > {tol:g}")
    checked = {"probe_abs_diff": delta, "probe_cached_after_refit": first["cached_tokens"],
               "probe_cached_second": second["cached_tokens"]}
    if trainer.lora_name is not None:
        checked["lora_version"] = adapter_version(engine)
    return checked


def rollout(engine: Any, trainer: Trainer, indices: list[int], n: int, version: str,
            routed: bool = False) -> tuple[list[Any], Optional[list[torch.Tensor]],
                                           dict[str, Any]]:
    """n samples of each problem of ``indices``, all at weight version ``version``: the
    rollouts, with ``routed`` each one's routing record (``grpo_moe.decode_records``: it
    comes in the same output, so it is of that same version), and the rollout's figures."""
    prompts = [trainer.task.prompts[i] for i in indices]
    start = time.perf_counter()
    extra = {"return_routed_experts": True} if routed else {}
    outputs = engine.generate(input_ids=prompts, sampling_params={
        "n": n, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0}, return_logprob=True,
        **extra, **policy(trainer))
    seconds = time.perf_counter() - start
    rollouts = to_rollouts(outputs, n)
    bad = sorted({v for r in rollouts for v in r.weight_versions} - {version})
    if bad or any(not r.weight_versions for r in rollouts):
        raise RefitCheckError(f"rollouts at weight version(s) {bad}, expected only {version!r}")
    for r in rollouts:
        if len(r.output_logprobs) != len(r.output_ids):
            raise RefitCheckError("a rollout came back without one logprob per output token")
    records = None
    if routed:
        try:
            records = decode_records(outputs, [prompts[r.prompt_index] for r in rollouts],
                                     trainer.model.config)
        except ValueError as e:
            raise RefitCheckError(f"routing replay: {e}") from None
    metas = [o["meta_info"] for o in outputs]
    tokens = sum(len(r.output_ids) for r in rollouts)
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    stats = {"rollout_seconds": seconds, "rollout_tokens": tokens,
             "rollout_tokens_per_s": tokens / seconds, "kv_hit_rate": cached / prompt_tokens,
             "cached_tokens": cached, "prompt_tokens": prompt_tokens}
    if records is not None:
        stats["routed_rollouts"] = len(records)
    return rollouts, records, stats


def evaluate(engine: Any, trainer: Trainer, n: int, version: str) -> dict[str, float]:
    """Sampled (T=1) reward and accuracy over all 100 problems, n samples each."""
    task = trainer.task
    indices = list(range(len(task.problems)))
    rollouts, _, _ = rollout(engine, trainer, indices, n, version)
    scores = [task.score(indices[r.prompt_index], r.output_ids) for r in rollouts]
    return {"reward": sum(s for s, _ in scores) / len(scores),
            "accuracy": sum(c for _, c in scores) / len(scores),
            "expected_accuracy": expected_accuracy(trainer.model, task)}


def run(args: argparse.Namespace, engine: Any, syncer: Any, trainer: Trainer, name: str,
        t_start: float) -> dict[str, Any]:
    """Warm-start refit (version "0"), then the GRPO steps; returns the summary."""
    spec = model_spec(args.moe)
    logger = RunLogger(Path(args.out_dir), name, dict(vars(args)), use_wandb=not args.no_wandb,
                       model=spec["arch"])
    report = syncer.sync(trainer.model, version="0")
    first_check = check_after_refit(engine, trainer, "0")
    eval_start = evaluate(engine, trainer, args.n, "0")
    rng = random.Random(args.seed)
    task, model = trainer.task, trainer.model
    # --lora: only the KV cache sleeps (the frozen base stays), the adapter's version moves
    sleep_tags = None if trainer.lora_name is None else SLEEP_TAGS
    lora_version = first_check.get("lora_version")
    setup_s = time.perf_counter() - t_start
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc=name, unit="step", dynamic_ncols=True)
    for step in range(args.steps):
        if time.perf_counter() - t_start > args.max_minutes * 60:
            print(f"[grpo] --max-minutes {args.max_minutes} reached after {step} steps")
            break
        version, new_version = str(step), str(step + 1)
        step_start = time.perf_counter()
        indices = task.sample(rng, args.prompts_per_step)
        rollouts, records, roll = rollout(engine, trainer, indices, args.n, version,
                                          routed=args.routing_replay)
        idx = [indices[r.prompt_index] for r in rollouts]
        scores = [task.score(i, r.output_ids) for i, r in zip(idx, rollouts)]
        rewards = [s for s, _ in scores]
        with engine_sleeping(engine, syncer, model, sleep_tags, version=new_version) as sleep:
            t = time.perf_counter()
            stats = train_step(model, trainer.opt, [task.prompts[i] for i in idx],
                               [r.output_ids for r in rollouts],
                               [r.output_logprobs for r in rollouts], rewards, args.n,
                               task.eos, args.clip, args.minibatches, args.entropy_coef,
                               not args.no_std_norm, scorer=trainer.scorer,
                               routed_experts=records)
            train_s = time.perf_counter() - t
        if sleep.sync is None or sleep.sync.version != new_version or sleep.bytes_freed <= 0:
            raise RefitCheckError(f"step {step}: the engine did not sleep and refit "
                                  f"(freed {sleep.bytes_freed} B, sync {sleep.sync})")
        if trainer.scorer is not None and stats["logprob_max_abs_diff"] != 0.0:
            raise RefitCheckError(f"step {step}: on-policy scoring differs from the rollout "
                                  f"by {stats['logprob_max_abs_diff']:.3g} (expected exactly 0)")
        # quantized rollouts: this difference is the measurement (the probe checks the refit)
        if trainer.quantization is None and not stats["logprob_abs_diff"] <= LOGPROB_TOL:
            raise RefitCheckError(f"step {step}: rollout vs trainer logprobs differ by "
                                  f"{stats['logprob_abs_diff']:.3g} > {LOGPROB_TOL:g}")
        check = check_after_refit(engine, trainer, new_version)
        if lora_version is not None:
            if sleep.sync.lora_versions != (check["lora_version"],) or \
                    check["lora_version"] <= lora_version:
                raise RefitCheckError(f"step {step}: the adapter's version did not move "
                                      f"({lora_version} -> {check['lora_version']}, the "
                                      f"sync reported {sleep.sync.lora_versions})")
            lora_version = check["lora_version"]
            check["adapter_refit_seconds"] = sleep.sync.seconds
        row = {"step": step, "weight_version": version, "new_weight_version": new_version,
               "reward": sum(rewards) / len(rewards),
               "accuracy": sum(c for _, c in scores) / len(scores),
               "response_length": sum(len(r.output_ids) for r in rollouts) / len(rollouts),
               "expected_accuracy": expected_accuracy(model, task),
               **roll, **stats, **check, "train_seconds": train_s,
               "sleep_seconds": sleep.release_seconds, "wake_seconds": sleep.resume_seconds,
               "refit_seconds": sleep.refit_seconds, "refit_bytes": sleep.sync.bytes,
               "refit_gbps": sleep.sync.gbps, "bytes_freed": sleep.bytes_freed,
               "step_seconds": time.perf_counter() - step_start,
               "elapsed_seconds": time.perf_counter() - t_start}
        logger.log(row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}",
                            exp_acc=f"{row['expected_accuracy']:.2f}",
                            refit=f"{1e3 * row['refit_seconds']:.1f}ms/"
                                  f"{row['refit_bytes'] / 1e6:.3g}MB")
    if bar is not None:
        bar.close()
    if not logger.rows:
        raise RuntimeError("no GRPO step ran (raise --max-minutes or --steps)")
    eval_end = evaluate(engine, trainer, args.n, logger.rows[-1]["new_weight_version"])
    minutes = (time.perf_counter() - t_start) / 60
    summary = summarize(logger.rows, minutes, {
        **{f"eval_start_{k}": v for k, v in eval_start.items()},
        **{f"eval_end_{k}": v for k, v in eval_end.items()},
        **trainer.warm, "setup_seconds": setup_s, "initial_refit_seconds": report.seconds,
        "initial_probe_abs_diff": first_check["probe_abs_diff"], "transport": report.transport,
        "model": spec, "routing_replay": args.routing_replay,
        "threads": args.threads, "cpu_count": os.cpu_count(),
        "on_policy": trainer.scorer is not None,
        "max_logprob_max_abs_diff": max(r["logprob_max_abs_diff"] for r in logger.rows),
        "lora": trainer.lora_name is not None, "quantization": trainer.quantization,
        **({} if trainer.lora_name is None else {
            "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha,
            "base_refit_seconds": syncer.base_report.seconds,
            "base_refit_bytes": syncer.base_report.bytes})})
    files = logger.finish(summary)
    summary["files"] = asdict_files(files)
    print_summary(summary)
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print(f"[grpo] {s['steps']} steps in {s['minutes']:.1f} min "
          f"(warm-start {s['warm_start_steps']} SFT steps, {s['warm_start_seconds']:.1f}s)")
    for key in ("reward", "accuracy", "expected_accuracy"):
        a, b = s["eval_start_" + key], s["eval_end_" + key]
        print(f"[grpo] {key:18s} {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points; all 100 "
              f"problems x n before step 0 / after the last step)")
    print(f"[grpo] per step: sleep {s['mean_sleep_seconds']:.3f}s, wake "
          f"{s['mean_wake_seconds']:.3f}s, refit {s['mean_refit_seconds']:.3f}s of "
          f"{s['mean_refit_bytes'] / 1e6:.3g} MB ({s['transport']}), train {s['mean_train_seconds']:.3f}s, rollout "
          f"{s['mean_rollout_tokens_per_s']:.0f} tok/s")
    if s.get("routing_replay"):
        print(f"[grpo] routing replay: the trainer's own router picks other experts than the "
              f"rollout in {100 * s['mean_routing_mismatch']:.2f}% of (token, layer) choices "
              f"(max {100 * s['max_routing_mismatch']:.2f}%); logprob mismatch without replay "
              f"{s['mean_logprob_abs_diff_unreplayed']:.2e}")
    if s.get("on_policy"):
        print(f"[grpo] on-policy: rollout vs trainer logprobs, max over every step and token "
              f"{s['max_logprob_max_abs_diff']:.1f} (bit for bit)")
    if s.get("lora"):
        print(f"[grpo] LoRA rank {s['lora_rank']}: the base refitted once "
              f"({s['base_refit_bytes'] / 1e6:.3g} MB in {s['base_refit_seconds']:.3f}s), then "
              f"only the adapter, {s['mean_refit_bytes'] / 1e6:.3g} MB a step")
    if s.get("quantization"):
        print(f"[grpo] quantized rollouts ({s['quantization']}): the engine samples from its "
              "quantized weights, the trainer scores in float32; the mismatch below is what "
              "that costs")
    print(f"[grpo] logprob mismatch: rollout vs trainer {s['mean_logprob_abs_diff']:.2e} "
          f"(K3 KL {s['mean_kl_k3']:.2e}); probe after refit max {s['max_probe_abs_diff']:.2e}"
          + (" (against the trainer fake-quantized the same way)" if s.get("quantization")
             else ""))
    print(f"[grpo] reward curve: {s['files']['plot']}")
    print(f"[grpo] step log:     {s['files']['jsonl']}")
