"""The refit-equivalence tests replayed on the sgemm code path of AMD machines.

On an AMD EPYC, MKL runs its AVX2 kernels, whose sgemm splits the reduction differently with
one thread (the reference engine in the test process) than with two (the engine's child
process): logprobs then differ in the 6th-7th digit and a bitwise comparison fails there
while it passes on an Intel AVX-512 machine. ``MKL_ENABLE_INSTRUCTIONS=AVX`` selects that
thread-count-dependent path on either kind of machine, so this runs the tests as CI on AMD
would, whatever machine runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPLAYED = ["test_weight_syncer.py", "test_colocate.py", "test_client_live.py"]


@pytest.mark.slow   # three test files replayed in a subprocess
def test_refit_equivalence_holds_on_mkls_avx2_path():
    env = dict(os.environ, MKL_ENABLE_INSTRUCTIONS="AVX")
    here = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *[str(here / f) for f in REPLAYED]]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]
