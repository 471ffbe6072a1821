"""Colocated GRPO on CPU: the trainer and the rollout engine share one machine.

    python examples/rl/grpo_colocated.py            # ~5 minutes on 2 busy cores
    python examples/rl/grpo_colocated.py --tiny     # CI smoke run, seconds
    python examples/rl/grpo_colocated.py --on-policy   # rollout == trainer logprobs, bit for bit
    python examples/rl/grpo_colocated.py --moe --routing-replay   # a tiny Qwen3-MoE with R3
    python examples/rl/grpo_colocated.py --lora --lora-rank 8   # train an adapter, refit only it

The engine (`rollout_engine.Engine`, scheduler in a child process) samples n completions per
prompt with logprobs; the trainer (a `transformers` model loaded from the same directory,
float32) scores them, and while it takes its GRPO step the engine sleeps (weights and KV
released). The engine then wakes and takes the new weights through
`WeightSyncer(transport="tensor")` (shared-memory handles), which bumps the weight version, so
no KV computed under the old weights is reused. See grpo_loop.py for the step, grpo_common.py
for the task, reward and loss. With --lora the trainer trains a LoRA adapter on the frozen
warm-started base: the base is refitted once, then each step only the KV cache sleeps and only
the adapter is synced (`LoraSyncer`, tensor handles; grpo_lora.py). Logs: JSONL + wandb
(offline) + a reward-curve PNG in --out-dir.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_loop import Trainer, add_common_args, resolve_args, run  # noqa: E402
from grpo_lora import LoraPolicySync, engine_flags  # noqa: E402


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, out_dir="runs/grpo_colocated")
    p.add_argument("--bucket-mb", type=int, default=64,
                   help="flattened-bucket size of the tensor refit")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="engine KV capacity")
    args = p.parse_args(argv)
    resolve_args(args)
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from rollout_engine import Engine
    from trainer_bridge import WeightSyncer

    args = parse_args(argv)
    t_start = time.perf_counter()
    trainer = Trainer(args)
    engine = Engine(model_path=str(trainer.model_dir), dtype="float32", device="cpu",
                    scheduler_mode="process", max_total_tokens=args.max_total_tokens,
                    num_threads=args.threads, random_seed=args.seed, weight_version="init",
                    enable_deterministic_inference=args.on_policy,
                    enable_return_routed_experts=args.routing_replay,
                    quantization=args.quantization, **engine_flags(args))
    try:
        with WeightSyncer(engine, transport="tensor",
                          bucket_bytes=args.bucket_mb << 20) as syncer:
            if args.lora:
                with LoraPolicySync(engine, trainer, syncer) as lora_syncer:
                    summary = run(args, engine, lora_syncer, trainer, "grpo_colocated",
                                  t_start)
            else:
                summary = run(args, engine, syncer, trainer, "grpo_colocated", t_start)
        engine.check_integrity()
    finally:
        engine.shutdown()
    return summary


if __name__ == "__main__":
    main()
