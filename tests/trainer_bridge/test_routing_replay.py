"""Rollout routing replay on the trainer's side (``trainer_bridge/routing_replay.py``): the
engine's record decodes; a transformers Qwen3-MoE / Qwen2-MoE model replaying the routing it
would pick itself computes exactly its own forward; a replayed expert is used with the
router's own (renormalised) probability as its gate, so the router keeps its gradient; shapes
that do not fit are refused."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_engine.testing.tiny_moe import tiny_moe_path
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
