"""An adapter's plan built again and again from the same tensors (a trainer resending the
same shared memory): each build reads the tensors' current values, never writes the memory of
an adapter still alive, and a non-finite value refuses the build."""

from __future__ import annotations

import gc
import re
from typing import Any

import pytest
import torch

from rollout_engine.models.lora import MODULES, LoraShapes
from rollout_engine.weights.lora_adapter import AdapterPlan
from tests.rollout_engine.lora.adapters import adapter_tensors, prompts

H, Q, KV = 12, 12, 6
SHAPES = LoraShapes({"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H),
                     "gate_proj": (H, 20), "up_proj": (H, 20), "down_proj": (20, H)},
                    num_layers=2, dense_mlp_layers=frozenset({0, 1}))
PRE = "base_model.model.model.layers.{}.self_attn.{}.lora_"
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _sources() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in (0, 1):
        for m, width in (("q_proj", Q), ("v_proj", KV)):
            out.append((PRE.format(layer, m) + "A.weight", torch.randn(4, H, generator=g)))
            out.append((PRE.format(layer, m) + "B.weight", torch.randn(width, 4, generator=g)))
    return out


def _values(adapter: Any) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (a.clone(), b.clone()) for k, (a, b) in adapter.weights.items()}


def test_a_plan_rebuilds_current_values_into_memory_no_live_adapter_holds() -> None:
    sources = _sources()
    plan = AdapterPlan(CONFIG, sources, SHAPES, 8, frozenset(MODULES), torch.float32)
    first = plan.build("a", "test")
    a0, b0 = first.weights[(0, "q_proj")]
    assert torch.equal(a0, sources[0][1]) and torch.equal(b0, sources[1][1])
    kept = _values(first)
    for _, t in sources:   # the trainer's step, in place
        t.mul_(2.0)
    second = plan.build("a", "test")
    assert torch.equal(second.weights[(0, "q_proj")][0], 2 * kept[(0, "q_proj")][0])
    for key, (a, b) in first.weights.items():   # still alive: untouched
        assert torch.equal(a, kept[key][0]) and torch.equal(b, kept[key][1])
    first_ptr = a0.data_ptr()
    del first, a0, b0
    gc.collect()
    third = plan.build("a", "test")   # the first adapter is gone: its memory is reused
    assert third.weights[(0, "q_proj")][0].data_ptr() == first_ptr
    assert second.weights[(0, "q_proj")][0].data_ptr() != first_ptr


def test_a_non_finite_value_refuses_the_build_and_names_the_tensor() -> None:
    sources = _sources()
    plan = AdapterPlan(CONFIG, sources, SHAPES, 8, frozenset(MODULES), torch.float32)
    good = plan.build("a", "test")
    kept = _values(good)
    sources[6][1][1, 2] = float("inf")
    with pytest.raises(ValueError, match=re.escape(f"{sources[6][0]!r}: holds non-finite")):
        plan.build("a", "test")
    for key, (a, b) in good.weights.items():
        assert torch.equal(a, kept[key][0]) and torch.equal(b, kept[key][1])
    sources[6][1][1, 2] = 0.0
    sources[3][1][0, 0] = float("nan")
    with pytest.raises(ValueError, match=re.escape(f"{sources[3][0]!r}: holds non-finite")):
        plan.build("a", "test")


def test_resent_shared_memory_serves_its_new_values_and_refuses_nan(
        make_engine: Any, qwen2_path: str, adapters: dict[str, str], vocab: int) -> None:
    """The trainer's tensors, moved into shared memory by the first load, are sent again
    after each in-place step: each load serves the values of its time."""
    engine = make_engine(qwen2_path, lora_paths=[f"dir={adapters['all8']}"], max_lora_rank=16)
    config, named = adapter_tensors(adapters["all8"])
    prompt = prompts(vocab, [11], seed=3)[0]

    def out(adapter: Any) -> Any:
        r = engine.generate(input_ids=prompt, lora_path=adapter, return_logprob=True,
                            sampling_params={"temperature": 0, "max_new_tokens": 8})
        return [r["output_ids"], [round(x[0], 4) for x in r["meta_info"]["output_token_logprobs"]]]

    with_dir, base = out("dir"), out(None)
    assert with_dir != base
    for step in range(2):
        engine.load_lora_adapter_from_tensors("live", named, config, upsert=True)
        assert out("live") == with_dir, step
        for n, t in named:
            if "lora_B" in n:
                t.zero_()
        engine.load_lora_adapter_from_tensors("live", named, config, upsert=True)
        assert out("live") == base, step
        b = next(t for n, t in named if "lora_B" in n)
        b[0, 0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            engine.load_lora_adapter_from_tensors("live", named, config, upsert=True)
        assert out("live") == base, step
        config, named = adapter_tensors(adapters["all8"])   # fresh tensors: a new payload
