"""Hand-built ForwardBatches over a ModelRunner's pools (no scheduler), for runner-level tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ToyReq:
    row: int
    slots: list[int]        # slots for positions [0, capacity)
    ids: list[int]          # tokens whose KV is (or is being) computed


def make_reqs(runner, prompts: list[list[int]], capacity: int) -> list[ToyReq]:
    """Give each prompt a table row and ``capacity`` slots, spread out (every other slot)."""
    reqs, next_slot = [], 0
    for prompt in prompts:
        row = runner.req_to_token.allocate()
        slots = list(range(next_slot, next_slot + 2 * capacity, 2))
        next_slot += 2 * capacity
        runner.req_to_token.write(row, 0, slots)
        reqs.append(ToyReq(row, slots, list(prompt)))
    assert next_slot <= runner.kv_pool.num_slots
    return reqs


def _t(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def prefill_batch(reqs: list[ToyReq], device: torch.device) -> ForwardBatch:
    ids, pos, loc, last = [], [], [], []
    for r in reqs:
        ids += r.ids
        pos += list(range(len(r.ids)))
        loc += r.slots[:len(r.ids)]
        last.append(len(ids) - 1)
    lens = [len(r.ids) for r in reqs]
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=_t(ids, device), positions=_t(pos, device),
        out_cache_loc=_t(loc, device), req_pool_indices=_t([r.row for r in reqs], device),
        seq_lens=_t(lens, device), prefix_lens=_t([0] * len(reqs), device),
        extend_lens=_t(lens, device), logits_indices=_t(last, device), seq_lens_list=lens,
        prefix_lens_list=[0] * len(reqs), extend_lens_list=lens)


def decode_batch(reqs: list[ToyReq], next_ids: list[int], device: torch.device) -> ForwardBatch:
    """One new token per request at position ``len(r.ids)``; appends it to ``r.ids``."""
    pos = [len(r.ids) for r in reqs]
    loc = [r.slots[p] for r, p in zip(reqs, pos)]
    for r, t in zip(reqs, next_ids):
        r.ids.append(t)
    lens = [p + 1 for p in pos]
    n = len(reqs)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=_t(next_ids, device), positions=_t(pos, device),
        out_cache_loc=_t(loc, device), req_pool_indices=_t([r.row for r in reqs], device),
        seq_lens=_t(lens, device), prefix_lens=_t(pos, device), extend_lens=_t([1] * n, device),
        logits_indices=_t(list(range(n)), device), seq_lens_list=lens, prefix_lens_list=pos,
        extend_lens_list=[1] * n)
