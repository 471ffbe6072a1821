"""LoRA serving against transformers + peft: each adapter's greedy tokens exactly, and its
logprobs within 1e-4, of the base model with that adapter merged in; adapters of every kind
(q/k/v/o/gate/up/down, rank 8 and 64, alpha != r, rsLoRA, all-linear) and the base model in
ONE batch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional

import pytest

from rollout_engine.models.lora import Stack
from tests.rollout_engine.lora.adapters import SPECS, assert_matches, prompts

MAX_NEW = 10
LENGTHS = [3, 9, 17, 30, 5, 12, 24, 7, 40, 2]


def _mixed(names: list[Optional[str]], vocab: int) -> tuple[list[list[int]], list[Optional[str]]]:
    """Two prompts per adapter (and per None: the base model), interleaved."""
    ps = prompts(vocab, LENGTHS[:2 * len(names)], seed=len(names))
    return ps, [names[i % len(names)] for i in range(len(ps))]


def _check(base: str, dirs: dict[str, str], ps: list[list[int]], which: list[Optional[str]],
           results: list[dict[str, Any]]) -> None:
    for prompt, name, res in zip(ps, which, results):
        assert_matches(base, None if name is None else dirs[name], prompt, res, MAX_NEW)


def _generate(engine: Any, ps: list[list[int]], which: list[Optional[str]]) -> list[dict]:
    return engine.generate(input_ids=ps, lora_path=which, return_logprob=True,
                           sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-slot"])
def test_one_batch_mixing_four_adapters_and_the_base_model(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        vocab: int, stacked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a batch applies its adapters (``models/lora.py``): every slot's stacked in
    one product, and slot by slot (where stacking would waste too much: here forced)."""
    monkeypatch.setattr(Stack, "MAX_EXTRA", float("inf") if stacked else 0.0)
    names: list[Optional[str]] = [*SPECS, None]
    engine = make_engine(qwen2_path, lora_paths=[f"{n}={adapters[n]}" for n in SPECS])
    ps, which = _mixed(names, vocab)
    _check(qwen2_path, adapters, ps, which, _generate(engine, ps, which))
    info = engine.get_server_info()
    assert sorted(info["loaded_adapters"]) == sorted(SPECS)
    assert info["loaded_adapters"]["qv64"]["rank"] == 64


def test_fewer_slots_than_adapters_and_chunked_prompts(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        vocab: int) -> None:
    """Two pool slots for four adapters: a batch admits at most two, the others wait, slots
    are evicted and refilled; prompts longer than a prefill chunk are cut across steps."""
    names: list[Optional[str]] = [*SPECS, None]
    engine = make_engine(qwen2_path, lora_paths=[f"{n}={adapters[n]}" for n in SPECS],
                         max_loras_per_batch=2, chunked_prefill_size=16)
    ps, which = _mixed(names, vocab)
    _check(qwen2_path, adapters, ps, which, _generate(engine, ps, which))


def test_requests_joining_a_running_batch(make_engine: Callable[..., Any], qwen2_path: str,
                                          adapters: dict[str, str], vocab: int) -> None:
    """Calls from threads: prefills with one adapter beside decodes with others."""
    names: list[Optional[str]] = [*SPECS, None]
    engine = make_engine(qwen2_path, lora_paths=[f"{n}={adapters[n]}" for n in SPECS])
    ps, which = _mixed(names, vocab)
    results: list[Any] = [None] * len(ps)
    started = threading.Barrier(len(ps))

    def run(i: int) -> None:
        started.wait()
        results[i] = _generate(engine, [ps[i]], [which[i]])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check(qwen2_path, adapters, ps, which, results)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_other_architectures(arch: str, tiny_paths: dict[str, str],
                             build_adapter: Callable[..., str], make_engine: Callable[..., Any],
                             vocab: int) -> None:
    base = tiny_paths[arch]
    dirs = {n: build_adapter(base, n) for n in ("all8", "mlp_rs")}
    engine = make_engine(base, lora_paths=[f"{n}={p}" for n, p in dirs.items()])
    ps, which = _mixed(["all8", "mlp_rs", None], 256)
    _check(base, dirs, ps, which, _generate(engine, ps, which))


def test_deterministic_mode_a_row_does_not_depend_on_its_batch(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        vocab: int) -> None:
    """With enable_deterministic_inference an adapter's request gives the same bits alone and
    beside requests of other adapters, and still matches the reference."""
    engine = make_engine(qwen2_path, enable_deterministic_inference=True,
                         lora_paths=[f"{n}={adapters[n]}" for n in ("all8", "qv64")])
    ps = prompts(vocab, [11, 6, 25, 4], seed=7)
    which: list[Optional[str]] = ["all8", "qv64", None, "all8"]
    together = _generate(engine, ps, which)
    alone = _generate(engine, ps[:1], which[:1])[0]
    assert alone["output_ids"] == together[0]["output_ids"]
    assert (alone["meta_info"]["output_token_logprobs"]
            == together[0]["meta_info"]["output_token_logprobs"])
    _check(qwen2_path, adapters, ps, which, together)


def test_mixture_of_experts_model_takes_attention_adapters_not_expert_ones(
        build_adapter: Callable[..., str], make_engine: Callable[..., Any]) -> None:
    """On a Qwen3-MoE model an adapter on the attention projections matches the merged
    reference; one on an MoE layer's MLP (its experts) is refused, saying so."""
    import torch

    from rollout_engine.testing.tiny_moe import tiny_moe_path
    from tests.rollout_engine.lora.adapters import AdapterSpec

    base = str(tiny_moe_path("qwen3_moe"))
    attn = build_adapter(base, "moe-attn", AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj",
                                                               "o_proj"), seed=5))
    engine = make_engine(base, lora_paths=[f"attn={attn}"], max_lora_rank=8,
                         lora_target_modules=["all"])
    ps, which = _mixed(["attn", None], 256)
    _check(base, {"attn": attn}, ps, which, _generate(engine, ps, which))
    expert = "base_model.model.model.layers.0.mlp.gate_proj.lora_"
    with pytest.raises(ValueError, match="layer 0's MLP is a mixture of experts: its experts "
                                         "take no adapter"):
        engine.load_lora_adapter_from_tensors(
            "experts", [(expert + "A.weight", torch.zeros(8, 64)),
                        (expert + "B.weight", torch.zeros(8, 8))],
            {"r": 8, "lora_alpha": 16, "target_modules": ["gate_proj"]})
