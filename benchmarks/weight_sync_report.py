"""The verdicts and chart of `bench_weight_sync.py`: each weight-sync goal by two statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GOALS = {"tensor": 1.5, "distributed": 1.2, "disk": 1.5}   # x each path's own roofline
ROOFLINE = {"tensor": "memcpy", "distributed": "raw broadcast", "disk": "read + copy"}

ROOFLINE_KEY = {"memcpy": "memcpy_seconds", "bf16 -> fp32 copy_": "cast_copy_seconds",
                "raw broadcast": "raw_broadcast_seconds", "read + copy": "read_copy_seconds"}


def roofline_of(row: dict[str, Any]) -> str:
    if row["transport"] == "tensor" and row["source_dtype"] != "float32":
        return "bf16 -> fp32 copy_"
    return ROOFLINE[row["transport"]]


def verdicts_of(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each weight-sync goal (`GOALS`: x each path's own roofline) on this model, by two
    statistics:

    paired (``met``): the median over rounds of each refit over its path's roofline timed
    just before it; for "no slower", that median of the bucketed row over the unbucketed
    row's (both normalized by their own rooflines, which cancels the machine's drift);
    best-of (``met_best_of``): a row's best refit over the roofline's best over all rounds,
    which pairs moments that may be minutes apart on a shared machine.
    """
    rows = [r for r in res["rows"] if r["source_dtype"] == "float32"]
    out = []
    for transport, goal in GOALS.items():
        mine = [r for r in rows if r["transport"] == transport
                and not r["syncer_writes_the_files"]]
        best = min(mine, key=lambda r: r["median_round_ratio"])
        out.append({"goal": f"{transport} <= {goal:g}x {ROOFLINE[transport]}",
                    "best": best["label"], "value": round(best["median_round_ratio"], 3),
                    "met": best["median_round_ratio"] <= goal,
                    "best_of": round(best["ratio_to_roofline"], 3),
                    "met_best_of": best["ratio_to_roofline"] <= goal})
        if transport == "tensor":   # next to it, the same goal over torch's copy_ alone
            by_copy = min(mine, key=lambda r: r["median_round_ratio_torch_copy"])
            out.append({"goal": f"tensor <= {goal:g}x torch copy_",
                        "best": by_copy["label"],
                        "value": round(by_copy["median_round_ratio_torch_copy"], 3),
                        "met": by_copy["median_round_ratio_torch_copy"] <= goal,
                        "best_of": round(by_copy["ratio_to_torch_copy"], 3),
                        "met_best_of": by_copy["ratio_to_torch_copy"] <= goal})
        plain = next((r for r in mine if r["bucket_bytes"] is None), None)
        for r in mine:
            if r["bucket_bytes"] is not None and plain is not None:
                paired = r["median_round_ratio"] / plain["median_round_ratio"]
                best_of = r["seconds"] / plain["seconds"]
                out.append({"goal": f"{r['label']} no slower than {plain['label']}",
                            "best": r["label"], "value": round(paired, 3), "met": paired <= 1.0,
                            "best_of": round(best_of, 3), "met_best_of": best_of <= 1.0})
    peer = res.get("vllm_reload")
    disk = next(r for r in rows if r["label"].startswith("disk (load"))
    if peer:
        ratio = disk["seconds"] / peer["best_seconds"]
        out.append({"goal": "disk refit faster than vLLM CPU reload_weights", "best": disk["label"],
                    "value": round(ratio, 3), "met": ratio < 1.0,
                    "best_of": round(ratio, 3), "met_best_of": ratio < 1.0})
    return [{"model": res["model"], **v} for v in out]


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(8 * len(results), 4.8), squeeze=False)
    colors = {"tensor": "tab:blue", "distributed": "tab:orange", "disk": "tab:gray"}
    for ax, res in zip(axes[0], results):
        rows = res["rows"]
        ax.bar(range(len(rows)), [r["ratio_to_roofline"] for r in rows],
               color=[colors[r["transport"]] for r in rows])
        for transport, goal in GOALS.items():
            ax.axhline(goal, color=colors[transport], ls=":", lw=1,
                       label=f"{transport} goal ({goal:g}x {ROOFLINE[transport]})")
        ax.axhline(1.0, color="red", ls="--", lw=1, label="the path's own roofline")
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=40, ha="right")
        ax.set_ylabel("refit seconds / roofline seconds (same run)")
        ax.set_title(f"{res['model']} qwen2 fp32 ({res['bytes'] / 1e9:.2f} GB) refit on CPU")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
