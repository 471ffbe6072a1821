"""The mixture-of-experts side of the GRPO examples: ``--moe`` trains a tiny Qwen3-MoE instead
of the dense qwen2, ``--routing-replay`` adds rollout routing replay (R3).

With R3 the engine records the experts every token was routed to during the rollout
(``return_routed_experts``), and the trainer's forwards over the rollout tokens (the
re-scoring before the update and every loss forward and backward of the update) route by
that record (``trainer_bridge.routing_replay.replay_routing``): the expert ids are the
rollout's, the gates the trainer's own router softmax at those ids, so the router still
learns. `routing_mismatch` measures what replay corrects: the share of (token, MoE layer)
choices where the trainer's router, left to itself, picks other experts than the rollout did.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional

import torch

from trainer_bridge.routing_replay import (
    decode_routed_experts,
    pad_routed_experts,
    replay_routing,
)

# the dense spec's attention and sizes; each layer's MLP becomes 8 experts of a quarter of
# the dense width, 2 active per token (~0.95M parameters, ~0.36M active per token)
MOE_MODEL_SPEC = dict(arch="qwen3_moe", hidden_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, intermediate_size=512, vocab_size=512, num_experts=8,
                      top_k=2, moe_intermediate_size=128)


def decode_records(outputs: Sequence[dict[str, Any]], prompts: Sequence[list[int]],
                   config: Any) -> list[torch.Tensor]:
    """Each output's ``meta_info["routed_experts"]`` as ``[len(prompt) + len(output) - 1,
    num_hidden_layers, top_k]`` int32 (``prompts[i]`` is output i's prompt). ValueError
    naming the output when one has no record or a record of the wrong size."""
    records = []
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        data = out["meta_info"].get("routed_experts")
        if data is None:
            raise ValueError(f"output {i} came back without meta_info.routed_experts (was the "
                             f"engine started with enable_return_routed_experts?)")
        try:
            records.append(decode_routed_experts(
                data, config.num_hidden_layers, config.num_experts_per_tok,
                num_tokens=len(prompt) + len(out["output_ids"])))
        except ValueError as e:
            raise ValueError(f"output {i}: {e}") from None
    return records


def _seq_len(prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> int:
    """The padded width `grpo_common.completion_logprobs` gives these sequences."""
    return max(len(p) + len(c) for p, c in zip(prompts, completions))


def replayed(model: torch.nn.Module, prompts: Sequence[list[int]],
             completions: Sequence[list[int]],
             records: Optional[Sequence[torch.Tensor]]) -> AbstractContextManager[None]:
    """Inside: ``model``'s forward over the right-padded batch ``prompt + completion`` routes
    by the rollout's ``records`` (one per sequence; padding positions route themselves). No
    records: a do-nothing context (the model routes by its own top-k)."""
    if records is None:
        return nullcontext()
    return replay_routing(model, pad_routed_experts(records, _seq_len(prompts, completions)))


def _routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer, router) of every sparse MoE block of a transformers Qwen3-MoE / Qwen2-MoE."""
    found = []
    for layer, block in enumerate(model.model.layers):
        gate = getattr(block.mlp, "gate", None)
        if gate is not None and hasattr(block.mlp, "experts"):
            found.append((layer, gate))
    if not found:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block")
    return found


def router_grad_norm(model: torch.nn.Module) -> float:
    """The L2 norm of the routers' gradients (0.0 when they have none): under replay the gates
    are the router's softmax at the given experts, so a loss still reaches it."""
    grads = [router.weight.grad for _, router in _routers(model)]
    return float(torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(g) if g is not None else torch.zeros(()) for g in grads])))


@contextmanager
def own_routing(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside: every forward of ``model`` writes, per MoE layer, the experts its router
    chose (``[tokens, top_k]``, tokens flattened as the router sees them) into the yielded
    dict; the hooks are removed on exit."""
    chosen: dict[int, torch.Tensor] = {}
    handles = []
    try:
        for layer, router in _routers(model):
            def hook(_m: Any, _i: Any, out: Any, layer: int = layer) -> None:
                chosen[layer] = out[2].detach()
            handles.append(router.register_forward_hook(hook))
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def routing_mismatch(chosen: dict[int, torch.Tensor], records: Sequence[torch.Tensor],
                     seq_len: int) -> float:
    """The share of (token, MoE layer) choices, over every row of every record, where the
    router's own experts (``chosen``, from `own_routing` over the padded batch of width
    ``seq_len``) are not the set the rollout used (top-k compared as sets: near-equal
    probabilities may order two experts either way)."""
    batch = len(records)
    differ, total = 0, 0
    for layer, ids in chosen.items():
        own = ids.view(batch, seq_len, -1).sort(-1).values
        for b, record in enumerate(records):
            rows = record.shape[0]
            given = record[:, layer].to(own.dtype).sort(-1).values
            differ += int((own[b, :rows] != given).any(-1).sum())
            total += rows
    return differ / max(total, 1)
