"""The decode kernel's shared-prefix plan is reused across decode steps while the batch keeps
its rows and no row's slots are rewritten (``ReqToTokenPool.generation``): a random run of
admissions (sharing a group's prompt or not), decode steps, finishes, prefix rewrites (the
radix cache handing a row its own slots for a prefix), a row passed to a new request in the
same place of the batch, and reorderings, where the plan the
backend uses must equal a fresh ``plan_decode`` at every step, and where steps that changed
nothing but the lengths must not plan again."""

from __future__ import annotations

import random

import pytest
import torch
from rollout_engine_kernels.cpu import paged_decode as cpu_paged

from rollout_engine.memory.kv_pool import KVPool, ReqToTokenPool
from rollout_engine.model_runner.attention.torch_native import TorchNativeBackend
from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

ROWS, MAX_LEN, PROMPT = 24, 160, 24
PLAN_FIELDS = ("rows", "seq_lens", "own_start", "members", "chunk_offsets", "chunk_lens")


def _decode_batch(rows: list[int], lens: list[int]) -> ForwardBatch:
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    b = len(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=t([0] * b), positions=t([n - 1 for n in lens]),
        out_cache_loc=t([0] * b), req_pool_indices=t(rows), seq_lens=t(lens),
        prefix_lens=t([n - 1 for n in lens]), extend_lens=t([1] * b),
        logits_indices=t(list(range(b))), seq_lens_list=list(lens),
        prefix_lens_list=[n - 1 for n in lens], extend_lens_list=[1] * b)


@pytest.mark.parametrize("seed", range(6))
def test_the_reused_plan_equals_a_fresh_one_at_every_step(seed, monkeypatch):
    rng = random.Random(seed)
    if cpu_paged.load_paged_decode() is None:
        pytest.fail("the CPU paged decode kernel did not build")
    pool = KVPool(ROWS * MAX_LEN * 2, 1, 1, 64, torch.float32, torch.device("cpu"))
    rtt = ReqToTokenPool(ROWS, MAX_LEN, torch.device("cpu"))
    backend = TorchNativeBackend(pool, rtt)
    planned = []
    real_plan = cpu_paged.plan_decode
    monkeypatch.setattr(cpu_paged, "plan_decode",
                        lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    fresh_slots = iter(range(pool.num_slots))
    prompts = [[next(fresh_slots) for _ in range(PROMPT)] for _ in range(4)]
    running: dict[int, list[int]] = {}     # row -> its slots
    order: list[int] = []                  # the batch's row order
    changed = True                         # since the last decode step: more than appends
    reused = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.15 and len(running) < ROWS:          # admit: a group's prompt, or fresh
            row = rtt.allocate()
            assert row is not None
            prefix = list(rng.choice(prompts)) if rng.random() < 0.7 else [
                next(fresh_slots) for _ in range(rng.randint(1, PROMPT))]
            running[row] = prefix + [next(fresh_slots)]
            rtt.write(row, 0, running[row])
            order.append(row)
            changed = True
        elif op < 0.22 and running:                    # finish
            row = rng.choice(order)
            order.remove(row)
            del running[row]
            rtt.free(row)
            changed = True
        elif op < 0.28 and running:                    # a prefix handed over by the cache
            row = rng.choice(order)
            keep = rng.randint(1, len(running[row]) - 1)
            new = list(rng.choice(prompts))[:keep] if rng.random() < 0.5 else [
                next(fresh_slots) for _ in range(keep)]
            running[row][:len(new)] = new
            rtt.write(row, 0, new)
            changed = True
        elif op < 0.36 and running:                    # a new request in a finished one's
            row = rng.choice(order)                    # row and place in the batch
            rtt.free(row)
            assert rtt.allocate() == row
            running[row] = list(rng.choice(prompts)) + [next(fresh_slots)]
            rtt.write(row, 0, running[row])
            changed = True
        elif op < 0.40 and len(order) > 1:             # the batch in another order
            rng.shuffle(order)
            changed = True
        elif order:                                    # a decode step: one slot more each
            for row in order:
                if len(running[row]) < MAX_LEN:
                    running[row].append(next(fresh_slots))
                    rtt.write(row, len(running[row]) - 1, running[row][-1:])
            lens = [len(running[r]) for r in order]
            fb = _decode_batch(order, lens)
            before = len(planned)
            backend.init_forward_metadata(fb)
            used = fb.attn_metadata.plan
            want = real_plan(rtt.table, fb.req_pool_indices, fb.seq_lens, max(lens))
            for name in PLAN_FIELDS:
                assert torch.equal(getattr(used, name), getattr(want, name)), name
            if not changed:
                assert len(planned) == before, "planned again though only lengths changed"
                reused += 1
            changed = False
    assert reused > 50
