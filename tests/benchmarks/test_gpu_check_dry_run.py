"""``benchmarks/gpu_check.py --cpu-dry-run``: every section's plumbing runs on CPU, one failing
section does not hide the others, and the table comes last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["parity", "kernels", "bandwidth", "e2e", "sleep", "refit"]


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run",
         "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow   # every section at once; the default suite runs two of them below
def test_dry_run_every_section(tmp_path):
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["mode"] == "cpu-dry-run"
    assert list(result["sections"]) == SECTIONS
    for name, sec in result["sections"].items():
        assert sec["status"] == "ok", (name, sec)
        assert sec["rows"], name
    assert result["sections"]["sleep"]["data"]["tokens_equal"] is True
    assert result["sections"]["refit"]["data"]["tokens_equal"] is True
    parity = result["sections"]["parity"]["rows"]
    # the three dense architectures and one MoE model (the dry run's CPU sizes)
    assert len(parity) == 4 and all(r[1] == "ok" for r in parity)
    assert "qwen3_moe" in parity[-1][0]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("| refit"), "the table must be printed last"


def test_a_failing_section_is_a_row_not_a_crash(tmp_path):
    proc, result = _run(tmp_path, "--sections", "kernels,bandwidth", "--fail", "kernels")
    assert proc.returncode == 1
    assert result["sections"]["kernels"]["status"] == "error"
    assert "injected" in result["sections"]["kernels"]["error"]
    assert result["sections"]["bandwidth"]["status"] == "ok"
    table = proc.stdout[proc.stdout.index("| section"):].splitlines()
    assert any(line.startswith("| kernels") and "ERROR" in line for line in table)
    assert table[-1].startswith("| bandwidth")
