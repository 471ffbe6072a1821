"""GRPO with a rollout fleet on Ray: two engines as Ray actors and one trainer.

    python examples/rl/grpo_fleet.py                 # 2 engines on a local Ray, 2 busy cores
    python examples/rl/grpo_fleet.py --tiny          # CI smoke run
    python examples/rl/grpo_fleet.py --ray-address auto --engines 4   # a running cluster

The loop is the colocated example's (grpo_loop.run: task, reward, model, warm-start and loss
from grpo_common.py) with a `trainer_bridge.ray.RayRolloutFleet` as its engine. Each engine is
a Ray actor in its own bundle of a placement group (1 CPU each here), running a
`rollout_engine.Engine`. Rollouts are split over the engines by the cache-aware dispatcher (a
prompt's n samples on one engine); while the trainer updates, the whole fleet sleeps; then it
wakes and is refitted by one torch.distributed broadcast (gloo on CPU: the trainer sends each
bucket once, every engine receives it). After every refit each engine is checked as the
colocated engine is (its weight version, no stale KV, probe logprobs equal to the trainer's),
and each engine's refit seconds are printed. Logs: JSONL + wandb (offline) + a reward-curve
PNG in --out-dir.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_common import ensure_model  # noqa: E402
from grpo_loop import Trainer, add_common_args, check_after_refit, resolve_args, run  # noqa: E402

from trainer_bridge.transports.base import spawn  # noqa: E402


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, out_dir="runs/grpo_fleet")
    p.add_argument("--engines", type=int, default=2, help="rollout engines (Ray actors)")
    p.add_argument("--cpus-per-engine", type=float, default=1.0,
                   help="CPUs each engine's placement-group bundle reserves")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--bucket-mb", type=int, default=64,
                   help="flattened-bucket size of the broadcast refit")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="each engine's KV capacity")
    p.add_argument("--print-every", type=int, default=10,
                   help="print the engines' refit seconds every this many refits")
    args = p.parse_args(argv)
    resolve_args(args)
    if args.lora:
        raise ValueError("--lora: the fleet refits by one broadcast of the full weights; "
                         "adapters are synced per engine (grpo_colocated.py or "
                         "grpo_server.py --lora)")
    if args.tiny:
        args.print_every = 1
    return args


class FleetRefits:
    """The loop's syncer: `fleet.sync` (one broadcast), then every engine proven on the new
    weights, each engine's refit seconds kept and printed."""

    def __init__(self, fleet: Any, trainer: Trainer, print_every: int) -> None:
        self.fleet, self.trainer, self.print_every = fleet, trainer, print_every
        self.per_engine: list[list[float]] = []   # one row per refit: seconds of each engine
        self.refit_seconds: list[float] = []      # the whole refit (all engines)
        self.check_seconds: list[float] = []      # the checks after it

    def sync(self, model: Any, version: Optional[str] = None) -> Any:
        report = self.fleet.sync(model, version)
        seconds = [r.seconds for r in self.fleet.last_refit.engines]
        self.per_engine.append(seconds)
        self.refit_seconds.append(report.seconds)
        start = time.perf_counter()
        for engine in self.fleet.engines:
            check_after_refit(engine, self.trainer, report.version)
        self.fleet.flush_cache()   # the loop probes the fleet once more: let it start cold
        self.check_seconds.append(time.perf_counter() - start)
        if (len(self.per_engine) - 1) % self.print_every == 0:
            each = ", ".join(f"engine {i} {s:.3f}s" for i, s in enumerate(seconds))
            print(f"[grpo_fleet] refit to {report.version}: {each} (one broadcast of "
                  f"{report.bytes / 1e6:.2f} MB, {report.seconds:.3f}s in all)", flush=True)
        return report


def start_ray(args: argparse.Namespace) -> Optional[str]:
    """Join --ray-address, or start a light local Ray; returns its temp dir (ours to remove)."""
    import ray

    from trainer_bridge.ray import start_local_ray

    if args.ray_address:
        ray.init(address=args.ray_address)
        return None
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    start_local_ray(num_cpus=math.ceil(args.engines * args.cpus_per_engine), temp_dir=temp_dir)
    return temp_dir


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from trainer_bridge.ray import LOCAL_ONLY_ENV, RayFleetConfig, RayRolloutFleet

    args = parse_args(argv)
    if not args.ray_address:
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")   # before ray's import: 127.0.0.1 only
    import ray
    t_start = time.perf_counter()
    own_ray = not ray.is_initialized()
    temp_dir = start_ray(args) if own_ray else None
    try:
        model_dir = ensure_model(Path(args.model_dir), args.seed, args.moe)   # before the engines load it
        config = RayFleetConfig(num_engines=args.engines, num_cpus_per_engine=args.cpus_per_engine,
                                bucket_bytes=args.bucket_mb << 20)
        engine_kwargs = {"model_path": str(model_dir), "dtype": "float32",
                         "max_total_tokens": args.max_total_tokens, "num_threads": args.threads,
                         "random_seed": args.seed, "weight_version": "init",
                         "enable_return_routed_experts": args.routing_replay,
                         "quantization": args.quantization}
        starting = spawn(RayRolloutFleet, engine_kwargs, config)   # while the trainer warms up
        trainer = Trainer(args)
        with starting.result() as fleet:
            refits = FleetRefits(fleet, trainer, args.print_every)
            summary = run(args, fleet, refits, trainer, "grpo_fleet", t_start)
            fleet.check_integrity()
            infos = fleet.infos
    finally:
        if own_ray:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    means = [sum(col) / len(col) for col in zip(*refits.per_engine)]
    summary.update(num_engines=args.engines, engine_refit_seconds=refits.per_engine,
                   mean_engine_refit_seconds=means,
                   mean_fleet_refit_seconds=_mean(refits.refit_seconds),
                   mean_check_seconds=_mean(refits.check_seconds),
                   engine_pids=[info["pid"] for info in infos])
    print("[grpo_fleet] mean refit seconds per engine: "
          + ", ".join(f"engine {i} {s:.3f}s" for i, s in enumerate(means))
          + f" over {len(refits.per_engine)} refits (one broadcast each: "
          f"{summary['mean_fleet_refit_seconds']:.3f}s for the fleet; the loop's 'refit' also "
          f"counts the checks of every engine after it, {summary['mean_check_seconds']:.3f}s)")
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    main()
