"""Rollout routing replay on the trainer's side (``trainer_bridge/routing_replay.py``): the
engine's record decodes; a transformers Qwen3-MoE / Qwen2-MoE model replaying the routing it
would pick itself computes exactly its own forward; a replayed expert is used with the
router's own (renormalised) probability as its gate, so the router keeps its gradient; shapes
that do not fit are refused. The acceptance: on a model whose experts come in near-tied pairs,
the trainer's logprobs differ from the engine's without replay and equal them within 1e-5 with
it. ``OnPolicyModel`` on MoE checkpoints: bitwise a deterministic engine's logprobs, a record
replayed in its value and gradient paths, the gradient transformers' under the same replay."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_engine.testing.tiny_moe import make_tiny_moe, tiny_moe_path
from trainer_bridge.on_policy import OnPolicyModel
from trainer_bridge.routing_replay import (
    decode_routed_experts,
    pad_routed_experts,
    replay_routing,
)

FAMILIES = ("qwen3_moe", "qwen2_moe")


def _hf(path: Path | str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _routers(model) -> list:
    return [layer.mlp.gate for layer in model.model.layers]


def own_routing(model, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the experts the model routed to: ``[B, S, L, k]``) of an unreplayed forward."""
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in _routers(model)]
    try:
        with torch.no_grad():
            logits = model(ids, **kwargs).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.stack(seen, 1).reshape(ids.shape[0], ids.shape[1], len(seen), -1)


def _another_first_expert(rows: torch.Tensor, num_experts: int = 8) -> torch.Tensor:
    """``rows`` (``[..., k]``) with slot 0 of each row moved to the first expert the row
    does not name."""
    out = rows.clone()
    flat = out.reshape(-1, out.shape[-1])
    for row in flat:
        row[0] = min(set(range(num_experts)) - set(row.tolist()))
    return out


def _unpatched(model) -> bool:
    return all("forward" not in vars(r) for r in _routers(model))


@pytest.fixture(scope="module", params=FAMILIES)
def hf_moe(request):
    return _hf(tiny_moe_path(request.param))


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[rng.randrange(5, 500) for _ in range(n)]])


# -- the engine's record ------------------------------------------------------------------------

def test_decode_reads_sglangs_format() -> None:
    rows = np.arange(5 * 3 * 2, dtype="<i4").reshape(5, 3, 2)
    rows[:, 1] = -1                                     # a dense layer
    text = base64.b64encode(rows.tobytes()).decode()
    got = decode_routed_experts(text, num_layers=3, top_k=2, num_tokens=6)
    assert got.dtype == torch.int32 and torch.equal(got, torch.from_numpy(rows.astype(np.int32)))
    with pytest.raises(ValueError, match="not a multiple of one row"):
        decode_routed_experts(text, num_layers=4, top_k=2)
    with pytest.raises(ValueError, match="a sequence of 5 tokens has 4"):
        decode_routed_experts(text, num_layers=3, top_k=2, num_tokens=5)
    with pytest.raises(ValueError, match="not base64"):
        decode_routed_experts("not*base64", num_layers=3, top_k=2)


# -- replay in transformers ---------------------------------------------------------------------

def test_replaying_the_models_own_routing_is_its_own_forward(hf_moe) -> None:
    ids = _ids(40)
    logits, routing = own_routing(hf_moe, ids)
    for record in (routing[0], routing[0, :-1], routing):   # [S], the engine's [S - 1], [B, S]
        with torch.no_grad(), replay_routing(hf_moe, record):
            assert torch.equal(hf_moe(ids).logits, logits)
        assert _unpatched(hf_moe)


def test_a_padded_batch_replays_each_sequence_and_routes_padding_itself(hf_moe) -> None:
    lengths, seq_len = [30, 22], 30
    ids = torch.cat([_ids(seq_len, 1), _ids(seq_len, 2)])
    mask = torch.tensor([[1] * n + [0] * (seq_len - n) for n in lengths])
    logits, routing = own_routing(hf_moe, ids, attention_mask=mask)
    records = [routing[b, :n - 1] for b, n in enumerate(lengths)]   # the engine's records
    batch = pad_routed_experts(records, seq_len)
    assert bool((batch[1, 21:] == -1).all()) and torch.equal(batch[1, :21], records[1])
    with torch.no_grad(), replay_routing(hf_moe, batch):
        assert torch.equal(hf_moe(ids, attention_mask=mask).logits, logits)
    # another expert for sequence 1 at position 10: only its positions 10.. change
    moved = batch.clone()
    moved[1, 10] = _another_first_expert(moved[1, 10])
    with torch.no_grad(), replay_routing(hf_moe, moved):
        got = hf_moe(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, :10], logits[1, :10], rtol=0, atol=1e-5)
    assert (got[1, 10] - logits[1, 10]).abs().max() > 1e-2


def test_replayed_experts_are_gated_by_the_routers_own_probabilities(hf_moe) -> None:
    ids = _ids(24, 3)
    _, routing = own_routing(hf_moe, ids)
    record = routing[0].flip(-1).clone()        # same experts, other slot order ...
    record[5:] = _another_first_expert(record[5:])   # ... and from position 5, other experts
    seen: dict[int, tuple] = {}
    routers = _routers(hf_moe)
    hooks = [r.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o))
             for n, r in enumerate(routers)]
    hf_moe.zero_grad()
    try:
        with replay_routing(hf_moe, record):
            out = hf_moe(ids).logits
            out.logsumexp(-1).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    norm = hf_moe.config.norm_topk_prob
    for n, (logits, gates, experts) in seen.items():
        assert torch.equal(experts, record[:, n].long())
        want = torch.softmax(logits, -1, dtype=torch.float).gather(1, experts)
        if norm:
            want = want / want.sum(-1, keepdim=True)
        assert torch.equal(gates, want)
        assert routers[n].weight.grad is not None and routers[n].weight.grad.abs().sum() > 0


def test_activation_checkpointing_recomputes_the_replayed_routing() -> None:
    model = _hf(tiny_moe_path("qwen3_moe"))
    ids = _ids(20, 4)
    _, routing = own_routing(model, ids)
    record = routing[0].clone()
    record[4:] = _another_first_expert(record[4:])

    def grads() -> torch.Tensor:
        model.zero_grad()
        with replay_routing(model, record):
            model(ids).logits.logsumexp(-1).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    plain = grads()
    model.activation_checkpointing_enable()
    model.train()
    assert torch.equal(grads(), plain)


def test_shapes_that_do_not_fit_are_refused(hf_moe, tiny_paths) -> None:
    ids = _ids(12)
    _, routing = own_routing(hf_moe, ids)
    good = routing[0]
    cases = [
        (good[:, :1], "num_hidden_layers=2, top_k=2"),               # layer count
        (good[..., :1], "num_hidden_layers=2, top_k=2"),             # top_k
        (good[0], r"give \[S, L, k\]"),                               # no token axis
        (good.float(), "integer expert ids"),
        (torch.full_like(good, 8), "expert id 8"),
        (good[:, :, :1].expand(-1, -1, 2), "same expert twice"),
    ]
    partial = good.clone()
    partial[3, 0, 0] = -1
    cases.append((partial, "expert id -1"))
    for record, message in cases:
        with pytest.raises(ValueError, match=message):
            with replay_routing(hf_moe, record):
                pass
        assert _unpatched(hf_moe)
    for rows in (good[:-2], torch.cat([good, good[:1]])):              # length, at the forward
        with pytest.raises(ValueError, match="this forward has 12 positions"):
            with torch.no_grad(), replay_routing(hf_moe, rows):
                hf_moe(ids)
        assert _unpatched(hf_moe)
    with replay_routing(hf_moe, good):
        with pytest.raises(ValueError, match="do not nest"):
            with replay_routing(hf_moe, good):
                pass
    assert _unpatched(hf_moe)
    with pytest.raises(ValueError, match="no Qwen3-MoE / Qwen2-MoE sparse block"):
        with replay_routing(_hf(tiny_paths["qwen3"]), good):
            pass


# -- the acceptance: near-tied experts ----------------------------------------------------------

@pytest.fixture(scope="module")
def near_tie_path(tmp_path_factory) -> Path:
    """A tiny top-1 Qwen3-MoE whose router rows come in pairs, row 2j+1 = row 2j times (1 + a
    relative perturbation of ~3e-7): a token's two best experts are always such a pair, their
    logits a few float32 roundings apart, so two correct float32 implementations pick
    differently for a fair share of tokens; the pair's experts have independent MLPs, so a
    flip changes the output."""
    path = make_tiny_moe(tmp_path_factory.mktemp("near_tie") / "model", "qwen3_moe", seed=3,
                         num_experts=8, top_k=1, norm_topk_prob=False)
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w[1::2] = w[0::2] * (1 + 3e-7 * torch.randn(w[0::2].shape, generator=gen))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _engine_record(policy: OnPolicyModel, seq: list[int], start: int) -> torch.Tensor:
    """The routing the deterministic engine used for ``seq`` in SGLang's layout ``[len - 1,
    num_hidden_layers, top_k]``, -1 in dense layers: the engine's own model class run on the
    sequence with a routing_out buffer (batch-invariant, so the rows are the generation's).
    Once the engine returns meta_info["routed_experts"], the end-to-end variant decodes that
    instead."""
    _, routing = policy.engine_logprobs(torch.tensor(seq), start, (0.0, -1, 0.0))
    moe, arch = policy.arch.moe, policy.arch
    record = torch.full((len(seq) - 1, arch.num_layers, moe.top_k), -1, dtype=torch.int32)
    record[:, list(moe.moe_layers)] = routing.to(torch.int32)
    return record


def test_with_replay_the_trainer_scores_the_engines_logprobs(near_tie_path, make_engine) -> None:
    engine = make_engine(str(near_tie_path), enable_deterministic_inference=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    outs = engine.generate(input_ids=prompts, return_logprob=True, sampling_params={
        "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    policy, hf = OnPolicyModel(str(near_tie_path)), _hf(near_tie_path)
    flips = choices = 0
    worst_plain = worst_replayed = 0.0
    for prompt, out in zip(prompts, outs):
        seq, start = prompt + out["output_ids"], len(prompt)
        returned = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        record = _engine_record(policy, seq, start)
        # the record is the routing behind the engine's numbers: replayed, bit for bit
        assert torch.equal(policy.token_logprobs(seq, start, 0.0, routed_experts=record),
                           returned)
        ids = torch.tensor([seq])
        logits, hf_routing = own_routing(hf, ids)
        flips += int((hf_routing[0, :-1] != record).any(-1).sum())
        choices += record.shape[0] * record.shape[1]
        worst_plain = max(worst_plain, float((_scores(logits, seq, start) - returned).abs().max()))
        with torch.no_grad(), replay_routing(hf, record):
            replayed = _scores(hf(ids).logits, seq, start)
        worst_replayed = max(worst_replayed, float((replayed - returned).abs().max()))
    assert flips >= 10, f"only {flips} of {choices} (token, layer) choices differ: no near ties"
    assert worst_plain > 1e-3, worst_plain
    assert worst_replayed <= 1e-5, f"replayed logprobs differ by {worst_replayed:.2e}"


def _scores(logits: torch.Tensor, seq: list[int], start: int) -> torch.Tensor:
    lp = torch.log_softmax(logits[0, start - 1:-1].double(), -1)
    return lp.gather(1, torch.tensor(seq[start:])[:, None])[:, 0].float()


# -- OnPolicyModel on MoE checkpoints -----------------------------------------------------------

SAMPLING = [{"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 0.7, "top_k": 20},
            {"temperature": 1.0, "min_p": 0.05}]


@pytest.mark.parametrize("family", FAMILIES)
def test_on_policy_moe_scores_bit_for_bit(make_engine, family) -> None:
    path = str(tiny_moe_path(family))
    engine = make_engine(path, enable_deterministic_inference=True, chunked_prefill_size=32,
                         num_threads=2)
    policy = OnPolicyModel(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 70))] for _ in SAMPLING]
    sps = [{**s, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": i}
           for i, s in enumerate(SAMPLING)]
    outs = engine.generate(input_ids=prompts, sampling_params=sps, return_logprob=True)
    for prompt, sp, out in zip(prompts, sps, outs):
        seq, start = prompt + out["output_ids"], len(prompt)
        returned = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        args = (seq, start, sp["temperature"], sp.get("top_k", -1), sp.get("min_p", 0.0))
        assert torch.equal(policy.token_logprobs(*args), returned), sp
        record = _engine_record(policy, seq, start)
        assert torch.equal(policy.token_logprobs(*args, routed_experts=record), returned), sp


@pytest.mark.parametrize("family", FAMILIES)
def test_on_policy_moe_gradient_is_transformers_replayed_gradient(family) -> None:
    path = tiny_moe_path(family)
    ours, hf = OnPolicyModel(str(path)), _hf(path)
    ids = _ids(30, 7)
    _, routing = own_routing(hf, ids)
    record = routing[0, :-1].clone()
    record[8:] = _another_first_expert(record[8:])      # experts the routers would not pick
    start, t = 6, 0.9
    total = ours.token_logprobs(ids[0], start, t, routed_experts=record).sum()
    total.backward()
    with replay_routing(hf, record):
        logits = hf(ids).logits[0, start - 1:-1]
        ref = torch.log_softmax(logits / t, -1).gather(1, ids[0, start:, None]).sum()
        ref.backward()
    torch.testing.assert_close(total, ref, rtol=0, atol=1e-4)
    moe = ours.arch.moe
    for layer in moe.moe_layers:
        mine, theirs = ours.model.layers[layer].mlp, hf.model.layers[layer].mlp
        assert mine.gate.weight.grad.abs().sum() > 0 and mine.w2.grad.abs().sum() > 0
        torch.testing.assert_close(mine.gate.weight.grad, theirs.gate.weight.grad,
                                   rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(mine.w13.grad.view_as(theirs.experts.gate_up_proj),
                                   theirs.experts.gate_up_proj.grad, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(mine.w2.grad.view_as(theirs.experts.down_proj),
                                   theirs.experts.down_proj.grad, rtol=1e-3, atol=1e-5)
        if mine.shared_gate is not None:
            torch.testing.assert_close(mine.shared_gate.weight.grad,
                                       theirs.shared_expert_gate.weight.grad,
                                       rtol=1e-3, atol=1e-5)


def test_on_policy_backward_goes_through_the_experts_the_values_used(near_tie_path) -> None:
    """Without a record the value path routes by the engine's products; the plain-torch
    recompute would break some near ties otherwise: the backward replays the value path's
    choice, so the gradient is the returned logprobs'."""
    policy = OnPolicyModel(str(near_tie_path))
    seq = _ids(60, 8)[0]
    start = 20

    def grads(score) -> torch.Tensor:
        policy.zero_grad()
        score().sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])

    record = _engine_record(policy, seq.tolist(), start)
    plain = grads(lambda: policy.token_logprobs(seq, start))
    assert torch.equal(plain, grads(lambda: policy.reference_logprobs(seq, start, 1.0,
                                                                      routed_experts=record)))
    # the recompute's own routing is another function here (the test's premise)
    own = grads(lambda: policy.reference_logprobs(seq, start, 1.0))
    assert (own - plain).abs().max() > 1e-3


def test_on_policy_refuses_a_record_that_does_not_fit(tiny_paths) -> None:
    policy = OnPolicyModel(str(tiny_moe_path("qwen3_moe")))
    seq = list(range(5, 15))
    good = torch.zeros(9, 2, 2, dtype=torch.int32)
    good[..., 1] = 1
    assert policy.token_logprobs(seq, 3, routed_experts=good).shape == (7,)
    for record, message in [(good[:8], r"needs \[9, 2, 2\]"), (good[:, :1], "num_hidden_layers=2"),
                            (torch.full_like(good, 9), "expert id 9"),
                            (torch.full_like(good, -1), "expert id -1")]:
        with pytest.raises(ValueError, match=message):
            policy.token_logprobs(seq, 3, routed_experts=record)
    with pytest.raises(ValueError, match="no MoE layers"):
        OnPolicyModel(tiny_paths["qwen3"]).token_logprobs(seq, 3, routed_experts=good)
