"""A CPU run never imports GPU-only packages: no Triton in the frontend or in the scheduler
child, so nothing of it is left to report leaks when the processes exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from rollout_engine import Engine
for mode in ("thread", "process"):
    engine = Engine(model_path=sys.argv[1], dtype="float32", device="cpu", scheduler_mode=mode)
    try:
        engine.generate("count to three", {"max_new_tokens": 4}, return_logprob=True)
    finally:
        engine.shutdown()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "triton")))
"""


@pytest.mark.slow   # a fresh interpreter generating
def test_cpu_generation_imports_no_triton(tiny_paths: dict[str, str]) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env.pop("TRITON_INTERPRET", None)   # the kernel tests' switch: not what a user runs with
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_paths["qwen2"]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert "nanobind: leaked" not in done.stderr, done.stderr[-3000:]
