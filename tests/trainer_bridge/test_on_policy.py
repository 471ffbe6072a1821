"""True on-policy scoring (``trainer_bridge/on_policy.py``): the trainer-side forward's logprob
of every sampled token is bitwise the one the engine (``enable_deterministic_inference``)
returned, for any sampling arguments the kernel serves and any thread count, also after an
optimiser step refit into the engine; its gradient is the logprob's (against transformers'
autograd on the same weights)."""

from __future__ import annotations

import random

import pytest
import torch

from trainer_bridge.on_policy import OnPolicyModel

SAMPLING = [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 0.0},
            {"temperature": 1.0, "top_k": 20}, {"temperature": 1.0, "min_p": 0.05}]


def _rollouts(engine, seed: int) -> tuple[list[list[int]], list[dict], list[dict]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 90))]
               for _ in range(len(SAMPLING))]
    sps = [{**s, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": i}
           for i, s in enumerate(SAMPLING)]
    return prompts, sps, engine.generate(input_ids=prompts, sampling_params=sps,
                                         return_logprob=True)


def _score(model: OnPolicyModel, prompt: list[int], sp: dict, out: dict) -> torch.Tensor:
    return model.token_logprobs(prompt + out["output_ids"], len(prompt), sp["temperature"],
                                sp.get("top_k", -1), sp.get("min_p", 0.0))


def _returned(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


@pytest.fixture(params=["qwen2", "llama"])
def setup(request, tiny_paths, make_engine):
    path = tiny_paths[request.param]
    engine = make_engine(path, enable_deterministic_inference=True, chunked_prefill_size=32,
                         num_threads=2)
    return path, engine


def test_every_sampled_token_scores_bit_for_bit(setup) -> None:
    path, engine = setup
    model = OnPolicyModel(path)
    prompts, sps, outs = _rollouts(engine, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the trainer's thread count need not be the engine's
    try:
        for prompt, sp, out in zip(prompts, sps, outs):
            assert torch.equal(_score(model, prompt, sp, out), _returned(out)), sp
    finally:
        torch.set_num_threads(threads)


def test_after_an_optimiser_step_and_a_refit_still_bit_for_bit(setup) -> None:
    path, engine = setup
    model = OnPolicyModel(path)
    prompts, sps, outs = _rollouts(engine, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = -torch.stack([_score(model, p, s, o).sum() for p, s, o in zip(prompts, sps, outs)]
                        ).sum()
    loss.backward()
    opt.step()
    ok, msg = engine.update_weights_from_tensor(model.named_weights())
    assert ok, msg
    prompts, sps, outs = _rollouts(engine, 3)
    for prompt, sp, out in zip(prompts, sps, outs):
        assert torch.equal(_score(model, prompt, sp, out), _returned(out)), sp


def test_the_gradient_is_the_logprobs(tiny_paths) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_paths["qwen3"]
    ours = OnPolicyModel(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([random.Random(4).randrange(5, 500) for _ in range(40)])
    start, t = 10, 0.8
    total = ours.token_logprobs(ids, start, t).sum()
    total.backward()
    logits = hf(ids[None]).logits[0, start - 1:-1]
    ref = torch.log_softmax(logits / t, -1).gather(1, ids[start:, None]).sum()
    ref.backward()
    torch.testing.assert_close(total, ref, rtol=0, atol=1e-4)
    name = "model.layers.1.mlp.down_proj.weight"
    ours_w = ours.model.weight_map()[name][0]
    torch.testing.assert_close(ours_w.grad, hf.get_parameter(name).grad, rtol=1e-3,
                               atol=1e-5)
    embed = ours.model.embed_tokens.weight.grad
    torch.testing.assert_close(embed, hf.get_parameter("model.embed_tokens.weight").grad,
                               rtol=1e-3, atol=1e-5)


def test_bad_input_is_refused(tiny_paths) -> None:
    model = OnPolicyModel(tiny_paths["qwen2"])
    with pytest.raises(ValueError, match="start must be"):
        model.token_logprobs([5, 6, 7], 3)
    with pytest.raises(ValueError, match="token ids must be in"):
        model.token_logprobs([5, 6, 10**6], 1)
