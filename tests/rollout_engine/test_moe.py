"""Mixture-of-experts models (``models/moe.py``): Qwen3-MoE and Qwen2-MoE (shared expert, a dense
layer among the MoE ones) against transformers, greedy token-exact and logprobs within 1e-4,
under chunked prefill, radix hits, retraction and n-gram speculation; the grouped expert path
against the per-expert loop; refits by per-expert and by transformers 5's stacked names, by
every trainer transport; sleep and wake."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rollout_engine.testing.tiny_moe import tiny_moe_path
from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.hf_reference import hf_greedy, hf_logprobs, hf_model

NEW = 10
SHARED = list(range(40, 100))    # a 60-token prefix: later prompts hit it in the radix cache
PROMPTS = [[1, 2, 3], SHARED + [5, 6], [9, 30, 200, 11, 300, 17] * 7, SHARED + [7, 8, 9]]
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
SHAPES = {"qwen3_moe": {}, "qwen2_moe": {"num_layers": 3, "mlp_only_layers": (1,)}}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def paths(family) -> tuple[str, str]:
    return (str(tiny_moe_path(family, **SHAPES[family])),
            str(tiny_moe_path(family, seed=1, **SHAPES[family])))


def _rollouts(engine: Any, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _assert_hf(path: str, rows: list[tuple[list[int], list[float]]],
               prompts: list[list[int]] = PROMPTS) -> None:
    for prompt, (ids, lps) in zip(prompts, rows):
        assert ids == hf_greedy(path, prompt, NEW), f"prompt of {len(prompt)}"
        ref = hf_logprobs(path, prompt + ids)[len(prompt):]
        assert (torch.tensor(lps) - ref).abs().max().item() <= 1e-4


def test_the_configs_read_as_moe(paths, family) -> None:
    from rollout_engine.models.llama import ModelArch
    from rollout_engine.weights.loader import read_hf_config

    arch = ModelArch.from_hf_config(read_hf_config(paths[0]))
    assert arch.moe is not None and arch.moe.num_experts == 8 and arch.moe.top_k == 2
    if family == "qwen2_moe":
        assert arch.moe.moe_layers == (0, 2) and arch.moe.shared_intermediate_size == 96
        assert arch.qkv_bias and not arch.qk_norm and not arch.moe.norm_topk_prob
    else:
        assert arch.moe.moe_layers == (0, 1) and arch.qk_norm and arch.moe.norm_topk_prob


def test_parity_with_transformers_chunked_and_on_radix_hits(paths, make_engine) -> None:
    engine = make_engine(paths[0], chunked_prefill_size=16, max_total_tokens=4096)
    first = _rollouts(engine)
    _assert_hf(paths[0], first)
    again = _rollouts(engine, PROMPTS[1::2])     # both share the cached 60-token prefix
    assert engine.get_server_info()["stats"]["cached_tokens"] >= 2 * len(SHARED)
    _assert_hf(paths[0], again, PROMPTS[1::2])


def test_parity_under_retraction(paths, make_engine) -> None:
    engine = make_engine(paths[0], max_total_tokens=160, max_running_requests=6)
    prompts = [[400 + 10 * i + j for j in range(4)] for i in range(5)]
    sp = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    assert engine.get_server_info()["stats"]["num_retractions"] > 0
    for prompt, o in zip(prompts, outs):
        assert o["output_ids"] == hf_greedy(paths[0], prompt, 40)


def test_ngram_speculation_keeps_the_tokens(paths, make_engine) -> None:
    engine = make_engine(paths[0], speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    prompts = [[9, 30, 200, 11, 300, 17] * 7, [5, 6, 7, 8] * 10]
    rows = _rollouts(engine, prompts)
    _assert_hf(paths[0], rows, prompts)


def test_refit_by_per_expert_and_stacked_names(paths, make_engine) -> None:
    engine = make_engine(paths[0])
    fresh = make_engine(paths[1])
    want = _rollouts(fresh)
    # per-expert names, as checkpoints and Megatron bridges send them
    ok, msg = engine.update_weights_from_tensor(list(iter_safetensors(paths[1])))
    assert ok, msg
    assert _rollouts(engine) == want
    # transformers 5's parameters: one [E, 2I, H] / [E, H, I] tensor per layer
    named = list(hf_model(paths[0]).named_parameters())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    ok, msg = engine.update_weights_from_tensor([(n, p.detach()) for n, p in named])
    assert ok, msg
    _assert_hf(paths[0], _rollouts(engine))


def test_stacked_and_per_expert_names_of_one_tensor_are_refused_together(paths, make_engine
                                                                         ) -> None:
    engine = make_engine(paths[0])
    named = dict(hf_model(paths[0]).named_parameters())
    stacked = "model.layers.0.mlp.experts.down_proj"
    twice = [(stacked, named[stacked].detach()),
             ("model.layers.0.mlp.experts.3.down_proj.weight", named[stacked][3].detach())]
    ok, msg = engine.update_weights_from_tensor(twice)
    assert not ok and "appears twice" in msg
    ok, msg = engine.update_weights_from_tensor([(stacked, named[stacked][:4].detach())])
    assert not ok and "shape" in msg
    _assert_hf(paths[0], _rollouts(engine, PROMPTS[:1]), PROMPTS[:1])


def test_sleep_and_wake_cover_the_experts(paths, make_engine) -> None:
    from rollout_engine.tokenizer_manager import EngineAsleepError

    engine = make_engine(paths[0], enable_memory_saver=True)
    freed = engine.release_memory_occupation()
    arch_bytes = sum(t.numel() * 4 for n, t in iter_safetensors(paths[0]) if ".experts." in n)
    assert freed["bytes_freed"] >= arch_bytes
    engine.resume_memory_occupation()
    with pytest.raises(EngineAsleepError, match="stale"):
        engine.generate(input_ids=[1, 2], sampling_params=GREEDY)
    # transformers 5's stacked expert tensors count as every expert's weights written
    named = [(n, p.detach()) for n, p in hf_model(paths[1]).named_parameters()]
    ok, msg = engine.update_weights_from_tensor(named)
    assert ok, msg
    _assert_hf(paths[1], _rollouts(engine))


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_grouped_experts_equal_the_per_expert_loop(rows) -> None:
    from rollout_engine.models.moe import MoEArch, SparseMoeBlock, route

    moe = MoEArch(num_experts=8, top_k=3, intermediate_size=24, norm_topk_prob=True,
                  moe_layers=(0,), shared_intermediate_size=0)
    block = SparseMoeBlock(32, moe, 0)
    g = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    x = torch.randn(rows, 32, generator=g)
    weights, ids = route(F.linear(x, block.gate.weight), moe.top_k, moe.norm_topk_prob)
    w13, w2 = block.w13.view(8, 48, 32), block.w2.view(8, 32, 24)
    want = torch.zeros_like(x)
    for t in range(rows):
        for j in range(moe.top_k):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            want[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e])
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a token's value does not depend on the others in its batch beyond rounding
    with torch.no_grad():
        alone = block(x[:1])
    torch.testing.assert_close(alone, got[:1], rtol=1e-5, atol=1e-5)


def test_deterministic_mode_a_request_in_any_batch_equals_it_alone(paths, make_engine) -> None:
    import random

    engine = make_engine(paths[0], enable_deterministic_inference=True, chunked_prefill_size=32)
    rng = random.Random(0)
    target = [rng.randrange(5, 500) for _ in range(70)]
    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}

    def run(prompts: list[list[int]]) -> tuple[list[int], list[float]]:
        outs = engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts),
                               return_logprob=True)
        return (outs[0]["output_ids"],
                [lp for lp, *_ in outs[0]["meta_info"]["output_token_logprobs"]])

    alone = run([target])
    for size in (3, 17, 40):
        neighbours = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 120))]
                      for _ in range(size)]
        assert run([target] + neighbours) == alone, size   # bit for bit; a radix hit too
