"""``benchmarks/bench_pd.py``'s workload builder, summary and verdict on made-up numbers (no
servers: the benchmark itself starts five processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_pd  # noqa: E402


def test_requests_follow_the_workload() -> None:
    w = bench_pd.Workload(decodes=3, decode_len=5, decode_new=7, longs=4, long_len=20,
                          long_new=2, intervals_ms=(250.0, 100.0), vocab=100, seed=1)
    req = bench_pd.build_requests(w)
    assert [len(p) for p in req.decode_prompts] == [5, 5, 5]
    assert sorted(req.long_prompts) == [100.0, 250.0]
    assert all([len(p) for p in run] == [20] * 4 for run in req.long_prompts.values())
    assert req.offsets_s(250.0) == [0.0, 0.25, 0.5, 0.75]
    assert len(req.solo_prompts) == bench_pd.SOLO_RUNS and len(req.warm_prompt) == 20
    longs = [*req.long_prompts[250.0], *req.long_prompts[100.0], *req.solo_prompts,
             req.warm_prompt]
    ids = {t for p in req.decode_prompts + longs for t in p}
    assert min(ids) >= 5 and max(ids) < 100
    # every long prompt starts differently: none is served from another's cached prefix
    assert len({tuple(p[:2]) for p in longs}) == len(longs)
    assert bench_pd.build_requests(w) == req   # seeded


@pytest.mark.parametrize("field, value", [("decodes", 0), ("long_len", 0),
                                          ("intervals_ms", (100.0, -1.0)), ("intervals_ms", ()),
                                          ("vocab", 5)])
def test_bad_workload_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        bench_pd.Workload(**{field: value})


def _rec(ttft: float, itl: list[float], tokens: int) -> dict:
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "e2e": ttft + sum(itl)}


def test_summary_of_fake_records() -> None:
    decodes = [_rec(0.1, [0.01, 0.02, 0.03], 4), _rec(0.1, [0.01, 0.5, 0.01], 4)]
    longs = [_rec(0.2, [0.01], 2), _rec(0.6, [0.01], 2), _rec(1.0, [0.01], 2)]
    s = bench_pd.summarize(decodes, longs, wall_s=2.0)
    assert s["generated_tokens"] == 14 and s["tok_s"] == 7.0
    assert s["decode_itl_ms"]["p50"] == pytest.approx(15.0)     # of the decodes' gaps only
    assert s["decode_itl_ms"]["max"] == pytest.approx(500.0)
    assert s["long_ttft_ms"]["p50"] == pytest.approx(600.0)     # of the long prompts only
    assert s["long_ttft_ms"]["p99"] == pytest.approx(992.0)
    assert "long_ttft_ms" not in bench_pd.summarize(decodes, [], wall_s=1.0)
    with pytest.raises(ValueError, match="wall_s"):
        bench_pd.summarize(decodes, longs, wall_s=0.0)


def test_verdict_says_where_pd_pays() -> None:
    def run(itl99: float, ttft50: float, tok_s: float) -> dict:
        return {"decode_itl_ms": {"p50": 1.0, "p99": itl99, "max": 2 * itl99},
                "long_ttft_ms": {"p50": ttft50}, "tok_s": tok_s}

    found = {"pd": {"solo_ttft_ms": 500.0, "alone": run(40.0, 0.0, 1.0),
                    "mixed 2500 ms": run(80.0, 900.0, 100.0)},
             "colocated": {"solo_ttft_ms": 300.0, "mixed 2500 ms": run(800.0, 600.0, 120.0)},
             "dp2": {"solo_ttft_ms": 400.0, "mixed 2500 ms": run(40.0, 450.0, 150.0)}}
    found["dp2"]["mixed 2500 ms"]["decode_itl_ms"]["max"] = 1000.0
    lines = bench_pd.verdict(found)
    assert lines[0] == ("pd, mixed 2500 ms: the arriving prompts raise the decodes' ITL p99 "
                        "2.00x over the decodes alone")
    assert lines[1].startswith("mixed 2500 ms, pd vs colocated: decode ITL p99 0.10x and "
                               "longest stall 0.10x (PD pays: the running")
    assert "long-prompt TTFT p50 1.50x (the transfer" in lines[1]
    assert lines[2].startswith("mixed 2500 ms, pd vs dp2: decode ITL p99 2.00x and longest "
                               "stall 0.16x (PD pays on one of the two)")
    assert lines[2].endswith("throughput 0.67x")
    assert len(lines) == 3
    rows = bench_pd.rows_of(found)
    assert rows[0] == ["pd", "solo", "-", "-", "-", "-", 500.0, "-"]
    assert rows[2] == ["pd", "mixed 2500 ms", 100.0, 1.0, 80.0, 160.0, 900.0, "-"]
    found["colocated"]["mixed 2500 ms"]["decode_itl_ms"].update(p99=10.0, max=100.0)
    assert "(PD does not pay here)" in bench_pd.verdict(found)[1]
    found["colocated"]["mixed 2500 ms"]["decode_itl_ms"].update(p99=800.0, max=50.0)
    assert "0.10x and longest stall 3.20x (PD pays on one of the two)" in bench_pd.verdict(found)[1]
