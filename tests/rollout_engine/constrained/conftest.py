"""Fixtures: the tiny Qwen2 model's tokenizer and xgrammar backends over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rollout_engine.constrained import XGrammarBackend

# the model's vocabulary past the tokenizer's (as when config.json pads it): never allowed
PADDED_VOCAB = 552


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2"))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def backend(tokenizer: Any) -> Iterator[XGrammarBackend]:
    be = XGrammarBackend(tokenizer, PADDED_VOCAB)
    yield be
    be.shutdown()
