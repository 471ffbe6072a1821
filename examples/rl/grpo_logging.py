"""The GRPO examples' logs: one JSON line per step, wandb (offline, optional), a reward-curve
PNG, and the run's summary (start and end figures, means over the steps)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunFiles:
    out_dir: Path
    jsonl: Path
    plot: Path


class RunLogger:
    """One JSON line per step, wandb (offline by default, optional), and a reward-curve PNG."""

    def __init__(self, out_dir: Path, name: str, config: dict[str, Any], use_wandb: bool,
                 model: str = "qwen2") -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model = model   # named in the plot's title
        self.files = RunFiles(out_dir, out_dir / f"{name}.jsonl", out_dir / f"{name}_reward.png")
        self.files.jsonl.write_text("")
        self.rows: list[dict[str, Any]] = []
        self.run = None
        if use_wandb:
            import os
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            try:
                import wandb
                self.run = wandb.init(project="rollout_engine-grpo", name=name, config=config,
                                      dir=str(out_dir), reinit=True)
            except Exception as e:  # noqa: BLE001 - wandb is optional
                print(f"[grpo] wandb unavailable ({type(e).__name__}: {e}); logging to JSONL only")

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.files.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float))},
                         step=row.get("step"))

    def finish(self, summary: dict[str, Any]) -> RunFiles:
        with self.files.jsonl.open("a") as f:
            f.write(json.dumps({"summary": summary}) + "\n")
        self.plot()
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items()
                                     if isinstance(v, (int, float, str))})
            self.run.finish()
        return self.files

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]

        def smooth(key: str, w: int = 10) -> list[float]:
            vals = [r[key] for r in self.rows]
            return [sum(vals[max(0, i - w + 1):i + 1]) / len(vals[max(0, i - w + 1):i + 1])
                    for i in range(len(vals))]

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [r["reward"] for r in self.rows], color="C0", alpha=0.25, lw=0.8)
        ax.plot(steps, smooth("reward"), color="C0", label="mean reward (sampled, 10-step avg)")
        ax.plot(steps, [r["accuracy"] for r in self.rows], color="C1", alpha=0.25, lw=0.8)
        ax.plot(steps, smooth("accuracy"), color="C1", label="accuracy (sampled, 10-step avg)")
        ax.plot(steps, [r["expected_accuracy"] for r in self.rows], color="C2",
                label="expected accuracy at T=1, all 100 problems")
        ax.set_xlabel("GRPO step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(f"GRPO on single-digit addition (tiny {self.model}, CPU)")
        fig.tight_layout()
        fig.savefig(self.files.plot, dpi=120)
        plt.close(fig)


def summarize(rows: list[dict[str, Any]], minutes: float, extra: dict[str, Any]) -> dict[str, Any]:
    """Start/end figures (means over the first and last 10% of steps, at least 3), means over
    every step (with routing replay also of ``routing_mismatch``), then ``extra``."""
    k = max(3, len(rows) // 10)
    head, tail = rows[:k], rows[-k:]

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    out = {"steps": len(rows), "minutes": minutes}
    for key in ("reward", "accuracy", "expected_accuracy"):
        out[f"start_{key}"], out[f"end_{key}"] = mean(head, key), mean(tail, key)
    for key in ("refit_seconds", "refit_bytes", "sleep_seconds", "wake_seconds", "rollout_tokens_per_s",
                "logprob_abs_diff", "kl_k3", "probe_abs_diff", "train_seconds"):
        out[f"mean_{key}"] = mean(rows, key)
    out["max_probe_abs_diff"] = max(r["probe_abs_diff"] for r in rows)
    if "routing_mismatch" in rows[0]:   # rollout routing replay
        for key in ("routing_mismatch", "logprob_abs_diff_unreplayed"):
            out[f"mean_{key}"] = mean(rows, key)
        out["max_routing_mismatch"] = max(r["routing_mismatch"] for r in rows)
    out.update(extra)
    return out


def asdict_files(files: RunFiles) -> dict[str, str]:
    return {k: str(v) for k, v in asdict(files).items()}
