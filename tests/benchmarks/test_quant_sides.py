"""``benchmarks/quant_sides.py``: side parsing, merging rounds and the tables, on made-up
numbers (no engines, no vLLM: the benchmark itself starts them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quant_sides  # noqa: E402


def test_sides_parse_to_engine_dtype_and_quantization() -> None:
    sides = quant_sides.parse_sides("float32, bfloat16,w8a8_int8,vllm:w8a8,vllm:float32")
    assert [(s.engine, s.dtype, s.quantization) for s in sides] == [
        ("ours", "float32", None), ("ours", "bfloat16", None), ("ours", "float32", "w8a8_int8"),
        ("vllm", "float32", "w8a8_int8"), ("vllm", "float32", None)]
    assert [s.name for s in quant_sides.parse_sides(quant_sides.DEFAULT_SIDES)] == [
        "float32", "bfloat16", "w8a8_int8", "vllm:w8a8", "vllm:float32"]


@pytest.mark.parametrize("text, message", [
    ("float32,vllm:int4", "unknown side(s) vllm:int4"),
    ("float32,float32", "named twice: float32"),
    (" , ", "no side named"),
])
def test_bad_sides_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quant_sides.parse_sides(text)


def test_best_of_keeps_the_fastest_run_and_the_quickest_refit() -> None:
    a = {"tok_s": {"16": 100.0, "64": 300.0}, "refit_s": 0.5, "int8_product": "kernel"}
    b = {"tok_s": {"16": 120.0, "64": 280.0}, "refit_s": 0.4, "int8_product": "kernel"}
    assert quant_sides.best_of(a, b) == {"tok_s": {"16": 120.0, "64": 300.0}, "refit_s": 0.4,
                                         "int8_product": "kernel"}
    assert quant_sides.best_of(None, b) is b
    vllm = {"tok_s": {"16": 50.0}, "refit_s": None, "loaded": {"quant_method": "X"}}
    merged = quant_sides.best_of(vllm, {"tok_s": {"16": 60.0}, "refit_s": None, "loaded": {}})
    assert merged == {"tok_s": {"16": 60.0}, "refit_s": None, "loaded": {"quant_method": "X"}}


def test_tables_show_every_side_and_only_the_ratios_of_sides_that_ran() -> None:
    sides = quant_sides.parse_sides("float32,bfloat16,w8a8_int8,vllm:w8a8")
    best = {"float32": {"tok_s": {"16": 200.0, "64": 400.0}},
            "bfloat16": {"tok_s": {"16": 50.0, "64": 100.0}},
            "w8a8_int8": {"tok_s": {"16": 300.0, "64": 500.0}},
            "vllm:w8a8": None}
    header, rows = quant_sides.tok_s_rows(best, sides, [16, 64])
    assert header == ["batch", "float32 tok/s", "bfloat16 tok/s", "w8a8_int8 tok/s",
                      "vllm:w8a8 tok/s"]
    assert rows == [[16, 200.0, 50.0, 300.0, "-"], [64, 400.0, 100.0, 500.0, "-"]]
    header, rows = quant_sides.ratio_rows(best, [16, 64])
    assert header == ["batch", "w8a8_int8 / float32", "w8a8_int8 / bfloat16"]
    assert rows == [[16, 1.5, 6.0], [64, 1.25, 5.0]]
