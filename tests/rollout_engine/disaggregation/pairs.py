"""Helpers for tests that drive a prefill engine and a decode engine as a PD router does."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LOCAL = "127.0.0.1"


def pair_generate(prefill: Any, decode: Any, prompt: Any, sampling_params: dict[str, Any],
                  room: int, **extra: Any) -> tuple[Any, Any]:
    """The same request with the same bootstrap fields sent to both engines at once (the PD
    router's way); returns (prefill's answer, decode's answer). ``prompt``: text or ids."""
    port = prefill.get_server_info()["disaggregation"]["bootstrap_port"]
    boot = {"bootstrap_host": LOCAL, "bootstrap_port": port, "bootstrap_room": room}
    given = {"input_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    got: dict[str, Any] = {}

    def run_prefill() -> None:
        try:
            got["prefill"] = prefill.generate(sampling_params=sampling_params, **given, **boot,
                                              **extra)
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            got["prefill"] = e

    thread = threading.Thread(target=run_prefill, daemon=True)
    thread.start()
    answer = decode.generate(sampling_params=sampling_params, **given, **boot, **extra)
    thread.join(60)
    if isinstance(got.get("prefill"), Exception):
        raise got["prefill"]
    return got["prefill"], answer


def segments() -> set[str]:
    """This process's prefill KV segments in shared memory."""
    mine = f"rollout_pd_{os.getpid()}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(mine)}


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``ok`` until it holds (AssertionError naming ``what`` after ``timeout_s``): for
    state another thread releases after the call that caused it has returned."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {timeout_s:g} s")
        time.sleep(0.01)


def kv_layout(model_path: str) -> dict[str, Any]:
    """The KV layout a float32 engine on ``model_path`` announces (``disaggregation/kv_io``)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "heads": cfg["num_key_value_heads"],
            "dim": dim, "dtype": "float32"}


def layout_bytes_per_token(layout: dict[str, Any]) -> int:
    return layout["layers"] * 2 * layout["heads"] * layout["dim"] * 4


def perturbed_checkpoint(src: str, dst: Path, seed: int = 0, scale: float = 0.5) -> str:
    """A copy of the checkpoint ``src`` in ``dst`` with noise added to every weight: a model
    that answers differently (the "trained" weights of a refit)."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(dst / "model.safetensors"))
    new = {name: (t + scale * t.std().nan_to_num(0.0) * torch.randn(t.shape, generator=gen)
                  ).contiguous() for name, t in weights.items()}
    save_file(new, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)
