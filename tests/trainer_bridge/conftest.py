"""Engines and trainer models for the trainer_bridge tests.

W1 and W2 are the same tiny Qwen2 architecture with different random weights. One
process-mode engine (tensor handles cross a real process boundary) starts from W1 and is
shared by the whole package; each test puts it back on W1 first.

What a sync must reproduce: the weights bit for bit (``get_weights_by_name`` is compared
exactly), the greedy tokens exactly, and the logprobs within ``LOGPROB_TOL``. Logprobs are not
compared bitwise across engines: the reference is a thread-mode engine in this process (one
intra-op thread, see tests/conftest.py) while the engine under test is a child process with
the machine's cores, and on some CPUs (MKL's AVX2 path on AMD) sgemm splits its reduction by
thread count, which moves the 6th-7th significant digit. ``test_amd_numerics.py`` replays these
tests on that code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 12]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
PROBE = "model.layers.0.mlp.down_proj.weight"


def rollouts(engine: Any) -> list[tuple[list[int], list[float], str]]:
    """Greedy (output ids, output logprobs, weight version) of each prompt, one at a time."""
    out = []
    for ids in PROMPTS:
        o = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        meta = o["meta_info"]
        out.append((o["output_ids"], [lp for lp, *_ in meta["output_token_logprobs"]],
                    meta["weight_version"]))
    return out


def tokens_and_logprobs(rows: list[tuple[list[int], list[float], str]]) -> list[Any]:
    return [(ids, lps) for ids, lps, _ in rows]


# fp32 logprobs of two engines whose matmuls sum in a different order (thread count, machine)
LOGPROB_TOL = 1e-5


def assert_same_rollouts(actual: list[Any], expected: list[Any]) -> None:
    """(ids, logprobs) pairs: ids token-exact, logprobs within ``LOGPROB_TOL``. Accepts the rows
    of ``rollouts`` (with a weight version) as well as bare pairs."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        (ids, lps), (want_ids, want_lps) = got[:2], want[:2]
        assert ids == want_ids, f"tokens differ: {ids} vs {want_ids}"
        assert len(lps) == len(want_lps) == len(ids)
        worst = max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0)
        assert worst <= LOGPROB_TOL, f"logprobs differ by {worst:.2e} > {LOGPROB_TOL}: " \
                                     f"{lps} vs {want_lps}"


@dataclass
class Weights:
    path: str
    model: Any                       # transformers model on these weights (the "trainer")
    expected: list[Any]              # (ids, logprobs) of a fresh engine on these weights
    probe: list[list[float]]         # first rows of PROBE


def _load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="package")
def engine(w1_w2: tuple[str, str]) -> Iterator[Any]:
    """The shared process-mode engine, started on W1."""
    from rollout_engine import Engine

    eng = Engine(model_path=w1_w2[0], dtype="float32", device="cpu")
    try:
        yield eng
        eng.check_integrity()  # no KV slot leaked across all the refits
    finally:
        eng.shutdown()


@pytest.fixture(scope="package")
def second_engine(w1_w2: tuple[str, str]) -> Iterator[Any]:
    """A second engine on W2; its first rollouts are the fresh-W2 reference. A thread-mode
    scheduler starts in half the time and computes bit-identical outputs."""
    from rollout_engine import Engine

    eng = Engine(model_path=w1_w2[1], dtype="float32", device="cpu", scheduler_mode="thread")
    try:
        yield eng
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.fixture(scope="package")
def w1(engine: Any, w1_w2: tuple[str, str]) -> Weights:
    expected = tokens_and_logprobs(rollouts(engine))  # the engine is still fresh on W1 here
    return Weights(w1_w2[0], _load_hf(w1_w2[0]), expected,
                   engine.get_weights_by_name(PROBE, 4))


@pytest.fixture(scope="package")
def w2(second_engine: Any, w1_w2: tuple[str, str]) -> Weights:
    expected = tokens_and_logprobs(rollouts(second_engine))
    return Weights(w1_w2[1], _load_hf(w1_w2[1]), expected,
                   second_engine.get_weights_by_name(PROBE, 4))


@pytest.fixture
def engine_on_w1(engine: Any, w1: Weights, w2: Weights) -> Any:
    """The shared engine, reset to W1 (through its own checkpoint reader) and proven there;
    the refit flushed the radix cache, so the next rollouts compute every prompt afresh."""
    ok, message = engine.update_weights_from_disk(w1.path, weight_version="w1")
    assert ok, message
    assert engine.get_weights_by_name(PROBE, 4) == w1.probe != w2.probe
    assert w1.expected != w2.expected
    return engine
