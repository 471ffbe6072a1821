"""The LoRA pieces on their own: the segment math against a row-by-row reference, the
registry's slots, versions and users, and the flags."""

from __future__ import annotations

import re
from typing import Any, Optional

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.config.lora import normalized_lora_paths
from rollout_engine.entrypoints.launch_server import parse_args
from rollout_engine.models import batch_invariant
from rollout_engine.models.lora import GROUPS, MODULES, LoraBatch, LoraPool, LoraShapes, Stack
from rollout_engine.protocol.messages import BusyError, GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.lora_registry import LoraRegistry
from rollout_engine.scheduler.request import Req
from rollout_engine.weights.lora_adapter import build_adapter

H, INTER, Q, KV = 12, 20, 12, 6
SHAPES = LoraShapes({"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H),
                     "gate_proj": (H, INTER), "up_proj": (H, INTER), "down_proj": (INTER, H)},
                    num_layers=2, dense_mlp_layers=frozenset({0}))   # layer 1: experts


def _weights(rank: int, modules: tuple[str, ...], seed: int
             ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {(layer, m): (torch.randn(rank, SHAPES.features[m][0], generator=g),
                         torch.randn(SHAPES.features[m][1], rank, generator=g))
            for layer in range(2) for m in modules if SHAPES.has(layer, m)}


def test_segments_equal_a_row_by_row_reference() -> None:
    pool = LoraPool(SHAPES, num_slots=3, max_rank=8, modules=frozenset(MODULES),
                    dtype=torch.float32, device=torch.device("cpu"))
    slots = {0: (8, 0.5, _weights(8, tuple(MODULES), 1)),
             1: (3, 2.0, _weights(3, ("q_proj", "v_proj", "down_proj"), 2)),   # k left out
             2: (5, 1.25, _weights(5, ("gate_proj", "o_proj"), 3))}
    for slot, (rank, scale, w) in slots.items():
        pool.write(slot, rank, scale, w)
    rows_of = [1, None, 0, 2, 1, 1, None, 0]          # each token row's slot (None: base)
    segments: list[tuple[int, Optional[torch.Tensor]]] = [
        (s, torch.tensor([i for i, r in enumerate(rows_of) if r == s])) for s in (0, 1, 2)]
    batch = LoraBatch(pool, segments)
    g = torch.Generator().manual_seed(9)
    for layer in range(2):
        for group, subs in GROUPS.items():
            if (layer, group) not in pool.a:
                assert group in ("gate_up_proj", "down_proj") and layer == 1   # the experts
                continue
            x = torch.randn(len(rows_of), SHAPES.features[subs[0]][0], generator=g)
            base = torch.randn(len(rows_of), sum(SHAPES.features[m][1] for m in subs),
                               generator=g)
            out = base.clone()
            batch.apply(layer, group, x, out)
            want = base.clone()
            for i, slot in enumerate(rows_of):
                if slot is None:
                    continue
                _, scale, w = slots[slot]
                col = 0
                for m in subs:
                    width = SHAPES.features[m][1]
                    if (layer, m) in w:
                        a, b = w[(layer, m)]
                        want[i, col:col + width] += (x[i] @ a.T @ b.T) * scale
                    col += width
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # one segment covering every row (rows None) is the same as its index
    whole = LoraBatch(pool, [(0, None)])
    idx = LoraBatch(pool, [(0, torch.arange(4))])
    x, base = torch.randn(4, H, generator=g), torch.randn(4, Q + 2 * KV, generator=g)
    a_out, b_out = base.clone(), base.clone()
    whole.apply(0, "qkv_proj", x, a_out)
    idx.apply(0, "qkv_proj", x, b_out)
    torch.testing.assert_close(a_out, b_out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stacked_slots_match_a_row_by_row_reference(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Stack`` (every slot in one product) against the update written out row by row: slots
    of different ranks and scales, each with its own modules, rows in no segment, every
    group; and the per-slot loop (deterministic mode's) against the same."""
    monkeypatch.setattr(Stack, "MAX_EXTRA", float("inf"))   # these small shapes: stacked
    g = torch.Generator().manual_seed(seed)
    kinds = [(2, MODULES), (8, ("q_proj", "v_proj", "up_proj")),
             (5, ("k_proj", "o_proj", "down_proj"))]
    pool = LoraPool(SHAPES, num_slots=3, max_rank=8, modules=frozenset(MODULES),
                    dtype=torch.float32, device=torch.device("cpu"))
    written = []
    for slot, (rank, modules) in enumerate(kinds):
        weights = {}
        for layer in (0, 1):
            for m in modules:
                if SHAPES.has(layer, m):
                    i, o = SHAPES.features[m]
                    weights[(layer, m)] = (torch.randn(rank, i, generator=g),
                                           torch.randn(o, rank, generator=g))
        pool.write(slot, rank, 0.5 + slot, weights)
        written.append(weights)
    rows = torch.randperm(11, generator=g)
    segments = [(0, rows[:3].sort().values), (1, rows[3:7].sort().values),
                (2, rows[7:10].sort().values)]   # rows[10] has no adapter
    for group, subs in GROUPS.items():
        width = sum(SHAPES.features[m][1] for m in subs)
        for layer in (0, 1):
            x = torch.randn(11, SHAPES.features[subs[0]][0], generator=g)
            base = torch.randn(11, width, generator=g)
            want = base.clone()
            for slot, seg in segments:
                lo = 0
                for m in subs:
                    hi = lo + SHAPES.features[m][1]
                    if (layer, m) in written[slot]:
                        a, b = written[slot][(layer, m)]
                        for r in seg.tolist():
                            want[r, lo:hi] += (0.5 + slot) * (b @ (a @ x[r]))
                    lo = hi
            got = base.clone()
            LoraBatch(pool, segments).apply(layer, group, x, got)
            stack = pool.stack((0, 1, 2), layer, group)
            assert (stack is None) == (layer == 1 and group in ("gate_up_proj", "down_proj"))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got[rows[10]], base[rows[10]])
            slot_by_slot = base.clone()
            with batch_invariant.forwards(True):   # the per-slot loop, one row at a time
                LoraBatch(pool, segments).apply(layer, group, x, slot_by_slot)
            torch.testing.assert_close(slot_by_slot, want, rtol=1e-4, atol=1e-4)


def _adapter(name: str, seed: int, rank: int = 4) -> Any:
    pre = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    g = torch.Generator().manual_seed(seed)
    return build_adapter(name, {"r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]},
                         [(pre + "A.weight", torch.randn(rank, H, generator=g)),
                          (pre + "B.weight", torch.randn(Q, rank, generator=g))],
                         SHAPES, 8, frozenset(MODULES), torch.float32, "test")


def _req(rid: str, adapter: Optional[str]) -> Req:
    return Req(GenerateReq(rid, [1, 2, 3], SamplingParams(), seed=0, lora_name=adapter), 0)


def test_registry_slots_versions_and_users() -> None:
    pool = LoraPool(SHAPES, num_slots=2, max_rank=8, modules=frozenset(MODULES),
                    dtype=torch.float32, device=torch.device("cpu"))
    reg = LoraRegistry(pool, torch.float32, max_loaded=3)
    reg.add(_adapter("a", 1), pinned=True)
    reg.add(_adapter("b", 2))
    reg.add(_adapter("c", 3))
    ra, rb, rc = _req("ra", "a"), _req("rb", "b"), _req("rc", "c")
    for r in (ra, rb, rc):
        assert reg.refusal(r) is None
        reg.bind(r)
    assert "no adapter named 'z'" in (reg.refusal(_req("rz", "z")) or "")
    # a batch uses at most two versions: the budget admits a third's request only beside them
    budget = reg.budget([ra, rb])
    assert budget.admits(_req("ra2", None)) and not budget.admits(rc)
    with pytest.raises(RuntimeError, match="more than 2 adapter slots"):
        reg.prepare([ra, rb, rc], [1, 1, 1])
    reg.prepare([ra], [2])
    reg.prepare([rb], [1])                   # b used last, but a is pinned: b makes room
    reg.prepare([rc], [1])
    assert rb.lora.slot is None and {ra.lora.slot, rc.lora.slot} == {0, 1}
    batch = reg.prepare([rb, rc], [1, 3])    # only a's slot can go now
    assert batch is not None
    assert rb.lora.slot is not None and rc.lora.slot is not None and ra.lora.slot is None
    assert [(s, None if rows is None else rows.tolist()) for s, rows in batch.segments] == [
        (rb.lora.slot, [0]), (rc.lora.slot, [1, 2, 3])]
    assert reg.prepare([_req("plain", None)], [4]) is None
    reg.check_integrity([ra, rb, rc])
    # an upsert: b's request keeps its version until it ends; the name is busy until then
    reg.add(_adapter("b", 4), upsert=True)
    old = rb.lora
    assert old.current is False and reg.current["b"] is not old
    with pytest.raises(BusyError, match="'b' is in use by 1 request"):
        reg.remove("b")
    reg.release(rb)
    reg.release(rb)                          # once only: the second is a no-op
    assert old not in reg.retired and old.slot is None and old.users == 0
    reg.remove("b")
    with pytest.raises(AssertionError, match="users recorded"):
        reg.check_integrity([ra])            # rc still holds c: the registry says so
    reg.check_integrity([ra, rc])


def test_lora_paths_forms_and_flags(qwen2_path: str, tmp_path: Any) -> None:
    assert normalized_lora_paths(["x=/a", "/b", '{"lora_name": "y", "lora_path": "/c", '
                                  '"pinned": true}', {"lora_name": "z", "lora_path": "/d"}]) == [
        {"lora_name": "x", "lora_path": "/a", "pinned": False},
        {"lora_name": "/b", "lora_path": "/b", "pinned": False},
        {"lora_name": "y", "lora_path": "/c", "pinned": True},
        {"lora_name": "z", "lora_path": "/d", "pinned": False}]
    assert normalized_lora_paths({"n": "/p"}) == [{"lora_name": "n", "lora_path": "/p",
                                                   "pinned": False}]
    with pytest.raises(ValueError, match="none of NAME=DIR"):
        normalized_lora_paths([{"lora_name": "n"}])
    kwargs = parse_args(["--model-path", qwen2_path, "--lora-paths", "a=/x", "b=/y",
                         "--max-loras-per-batch", "2", "--lora-target-modules", "q_proj",
                         "v_proj", "--max-lora-rank", "16", "--max-loaded-loras", "4"])
    assert kwargs["lora_paths"] == ["a=/x", "b=/y"]
    assert kwargs["lora_target_modules"] == ["q_proj", "v_proj"]
    assert (kwargs["max_loras_per_batch"], kwargs["max_lora_rank"],
            kwargs["max_loaded_loras"]) == (2, 16, 4)
    cfg = EngineConfig.from_kwargs(model_path=qwen2_path, enable_lora=True, max_lora_rank=8,
                                   lora_target_modules=["all"])
    assert cfg.lora_paths is None and cfg.max_loras_per_batch == 8


@pytest.mark.parametrize("flags, message", [
    ({"enable_lora": True}, "without lora_paths, give max_lora_rank and lora_target_modules"),
    ({"tp_size": 2, "scheduler_mode": "process"}, "enable_lora: is not supported with "
     "tp_size=2"),
    ({"dp_size": 2}, "enable_lora: is not supported with dp_size=2"),
    ({"enable_hierarchical_cache": True}, "is not supported with enable_hierarchical_cache"),
    ({"speculative_algorithm": "NGRAM"}, "is not supported with speculative_algorithm"),
    ({"max_loras_per_batch": 0}, "max_loras_per_batch: must be >= 1"),
    ({"max_loaded_loras": 1, "max_loras_per_batch": 2}, "max_loaded_loras: must be >="),
    ({"lora_target_modules": ["lm_head"]}, "['lm_head'] are not supported"),
    ({"lora_paths": ["a=/nowhere"]}, "'/nowhere' (adapter 'a') is not a PEFT adapter"),
])
def test_flags_that_cannot_be_honoured_are_refused(qwen2_path: str, flags: dict[str, Any],
                                                   message: str) -> None:
    base = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]}
    if "lora_paths" in flags or flags.get("enable_lora"):
        base = {}
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig.from_kwargs(model_path=qwen2_path, **{**base, **flags})
