"""GRPO with LoRA (--lora): the trainer trains a PEFT adapter on a frozen base, and each step
only the adapter reaches the engine.

    start:      warm-start the full model (the SFT base) -> one full refit of the base
                (WeightSyncer, version "0") -> wrap it with peft LoRA (every projection; B
                starts at zero, so the policy is the base) -> load the adapter as "policy"
    each step:  rollouts ask lora_path="policy" -> the engine's KV cache is released while the
                trainer steps (the base weights stay: they never change, so releasing them
                would mean sending them again) -> resumed -> the adapter upserted
                (LoraSyncer: its tensors only) -> the engine's weight_version relabelled to
                the policy's step

The relabel is what puts the policy's step on the rollouts (the engine reports no adapter
version on a request); in this loop no request runs between the upsert and the relabel, so
every rollout labelled k was sampled with adapter k. The step log records the adapter refit's
seconds and bytes and the adapter's version on the engine (``lora_version``, which moves every
step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

LORA_NAME = "policy"
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SLEEP_TAGS = ["kv_cache"]   # what a LoRA step releases (the frozen base stays)


def wrap_with_lora(model: torch.nn.Module, rank: int, alpha: float) -> torch.nn.Module:
    """``model`` (its weights frozen) under a peft LoRA adapter on every projection."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                            target_modules=list(LORA_MODULES)))


def engine_flags(args: Any) -> dict[str, Any]:
    """The Engine keywords a --lora run needs (none without --lora)."""
    if not args.lora:
        return {}
    return {"enable_lora": True, "max_lora_rank": args.lora_rank,
            "lora_target_modules": ["all"]}


def server_flags(args: Any) -> list[str]:
    """``engine_flags`` as launch_server's command-line flags."""
    if not args.lora:
        return []
    return ["--enable-lora", "--max-lora-rank", str(args.lora_rank),
            "--lora-target-modules", "all"]


@dataclass(frozen=True)
class AdapterStep:
    """What the loop reads of a sync (as of a SyncReport), plus the adapter's versions."""

    version: str
    bytes: int
    seconds: float
    gbps: float
    transport: str
    lora_versions: tuple[int, ...]


class LoraPolicySync:
    """The loop's syncer in --lora mode: ``sync(peft_model, version)`` upserts the adapter on
    the engine (``LoraSyncer``) and relabels its weight_version ``version``. Construction
    refits the trainer's frozen base through ``base_syncer`` (a ``WeightSyncer``) once."""

    sleep_tags = SLEEP_TAGS

    def __init__(self, engine: Any, trainer: Any, base_syncer: Any,
                 transport: str = "tensor") -> None:
        from trainer_bridge import LoraSyncer

        self.engine = engine
        self.base_report = base_syncer.sync(trainer.base_weights, version="0")
        self.syncer = LoraSyncer(engine, LORA_NAME, transport=transport)

    def sync(self, model: Any, version: Optional[str] = None) -> AdapterStep:
        if version is None:
            raise ValueError("version: the LoRA loop labels every policy version")
        report = self.syncer.sync(model)
        self.engine.update_weight_version(version, abort_all_requests=False)
        return AdapterStep(version, report.bytes, report.seconds, report.gbps,
                           f"lora-{report.transport}", report.versions)

    def close(self) -> None:
        self.syncer.close()

    def __enter__(self) -> LoraPolicySync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def adapter_version(engine: Any) -> int:
    """The adapter's version on ``engine`` now."""
    return int(engine.get_server_info()["loaded_adapters"][LORA_NAME]["version"])
