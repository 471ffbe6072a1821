"""Adapters for the LoRA tests: built once per session with peft, on the tiny models."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.rollout_engine.lora.adapters import SPECS, AdapterSpec, make_adapter


@pytest.fixture(scope="session")
def build_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``build_adapter(base, name, spec=None)``: a PEFT directory (``SPECS[name]`` unless
    ``spec``), built once per (base, name)."""
    built: dict[tuple[str, str], str] = {}

    def build(base: str, name: str, spec: AdapterSpec | None = None) -> str:
        key = (base, name)
        if key not in built:
            out = str(tmp_path_factory.mktemp(f"lora-{name}"))
            built[key] = make_adapter(base, out, spec or SPECS[name])
        return built[key]

    return build


@pytest.fixture(scope="session")
def adapters(build_adapter: Callable[..., str], qwen2_path: str) -> dict[str, str]:
    """Every adapter of ``SPECS`` on the tiny qwen2, by name."""
    return {name: build_adapter(qwen2_path, name) for name in SPECS}


@pytest.fixture(scope="session")
def vocab(qwen2_path: str) -> int:
    with open(f"{qwen2_path}/config.json") as f:
        return int(json.load(f)["vocab_size"])
