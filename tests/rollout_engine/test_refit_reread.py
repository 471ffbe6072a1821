"""A repeated refit payload is not read again: `MappedStorages` keeps what the same string read
to while its storages stay mapped (the files still checked; a lent payload's reread takes and
drops no shm reference), and `plan_targets` checks a repeated (name, shape, dtype) list once but
always writes through the parameters' current storage. A read leaves nothing in a reference
cycle that would keep the sender's shared memory mapped until the next garbage collection."""

from __future__ import annotations

import gc
import os
import struct

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from torch import nn

from rollout_engine.protocol.bucket import FlattenedBucket, pack_buckets
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.protocol.tensor_handles import OpenedShm, ReadContext
from rollout_engine.protocol.tensor_payload import deserialize_named_tensors
from rollout_engine.weights import loader, refit
from rollout_engine.weights.refit import MappedStorages


def _shm_refcount(t: torch.Tensor) -> int:
    """The shm file's reference count (RefcountedMapAllocator's header: an int at byte 0)."""
    _manager, handle, _size = t.untyped_storage()._share_filename_cpu_()
    with open("/dev/shm" + handle.decode(), "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def _read(mapped: MappedStorages, text: str) -> list[tuple[str, torch.Tensor]]:
    """What refit_from_serialized does around load_weights: reread, else read and remember."""
    key = (text, None)
    named = mapped.reread(key)
    if named is None:
        opened: list[OpenedShm] = []
        named = deserialize_named_tensors(text, opened=opened)
        mapped.keep(named)
        mapped.remember(key, named, opened)
    else:
        mapped.keep(named)
    return named


def test_a_repeated_payload_is_reread_with_current_values_and_balanced_references():
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3))]
    mapped = MappedStorages(1 << 20)
    text = serialize_named_tensors(weights)
    first = _read(mapped, text)
    assert mapped.num_payloads == 1
    counts = [_shm_refcount(t) for _, t in weights]
    for step in range(5):
        weights[0][1].add_(1)                        # an optimizer step, in place
        again = serialize_named_tensors(weights)     # the same storages: the same string
        assert again == text
        named = _read(mapped, again)
        assert named is first                        # not parsed or rebuilt
        assert torch.equal(named[0][1], torch.arange(6.0) + step + 1)
        # the sender lends its storages: a reread neither takes nor drops a reference
        assert [_shm_refcount(t) for _, t in weights] == counts


def test_a_payload_is_forgotten_once_its_storages_are_pushed_out():
    old = [("a", torch.zeros(256))]                  # 1 KiB
    mapped = MappedStorages(1536)
    text = serialize_named_tensors(old)
    _read(mapped, text)
    assert mapped.num_payloads == 1
    new = [("b", torch.zeros(256))]
    _read(mapped, serialize_named_tensors(new))   # 2 KiB kept: over
    assert mapped.num_storages == 1 and mapped.num_payloads == 1
    assert mapped.reread((text, None)) is None
    mapped.clear()
    assert mapped.num_payloads == 0 and mapped.num_storages == 0


def test_a_shrunk_shm_file_sends_the_payload_back_to_the_full_read(monkeypatch):
    weights = [("a", torch.zeros(1024))]
    mapped = MappedStorages(1 << 20)
    text = serialize_named_tensors(weights)
    _read(mapped, text)
    real_stat = os.stat

    class Short:
        st_size = 100

    monkeypatch.setattr(refit.os, "stat", lambda p: Short() if "torch_" in str(p)
                        else real_stat(p))
    assert serialize_named_tensors(weights) == text   # sent again
    assert mapped.reread((text, None)) is None
    monkeypatch.undo()
    deserialize_named_tensors(text)    # the full read the refit falls back to


def test_a_read_leaves_no_reference_cycle_holding_shared_memory():
    bucket = next(iter(pack_buckets([("a", torch.arange(8.0)), ("b", torch.ones(3))], 1 << 20)))
    x = {"x": torch.zeros(4)}
    payloads = [serialize_named_tensors(bucket), serialize_named_tensors(x)]
    gc.collect()
    gc.disable()
    try:
        for text in payloads:
            out = deserialize_named_tensors(text)
            assert isinstance(out, (FlattenedBucket, dict))
            del out
        assert not [o for o in gc.get_objects() if isinstance(o, ReadContext)]
    finally:
        gc.enable()


class _Fused(nn.Module):
    """weight_map as the engine's models give it: two checkpoint tensors in one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.qk = nn.Parameter(torch.zeros(6, 3), requires_grad=False)

    def weight_map(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        return {"w": (self.w, 0, 4), "q": (self.qk, 0, 2), "k": (self.qk, 2, 4)}


def test_a_repeated_plan_is_checked_once_and_writes_the_current_storage(monkeypatch):
    model = _Fused()
    plans = []
    real = loader._plan
    monkeypatch.setattr(loader, "_plan", lambda *a: plans.append(1) or real(*a))
    update = [("w", torch.ones(4, 3)), ("k", torch.full((4, 3), 2.0))]
    loader.load_weights(model, update)
    model.w.data = torch.zeros(4, 3)        # what sleep and wake do: new storage, same Parameter
    model.qk.data = torch.zeros(6, 3)
    loader.load_weights(model, update)
    assert len(plans) == 1
    assert torch.equal(model.w, torch.ones(4, 3))
    assert torch.equal(model.qk[2:], torch.full((4, 3), 2.0))
    assert torch.equal(model.qk[:2], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        loader.load_weights(model, [("w", torch.ones(3, 3))])
    assert len(plans) == 2


def test_a_resent_payload_is_applied_by_its_first_plan_until_a_parameter_gets_new_storage(
        monkeypatch):
    """refit_from_serialized: the same string again is applied by the plan its first read made
    (nothing checked or worked out again), with the shm's current values; once a parameter has
    new storage (a broadcast's shadow swap, as here by hand) a fresh plan writes that storage."""
    model = _Fused()
    plans = []

    class Counted(loader.LoadPlan):
        def __init__(self, *args, **kwargs):
            plans.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(refit, "LoadPlan", Counted)
    mapped = MappedStorages(1 << 20)
    weights = [("w", torch.ones(4, 3)), ("k", torch.full((4, 3), 2.0))]
    text = serialize_named_tensors(weights)
    report = refit.refit_from_serialized(model, [text], None, mapped)
    assert report.names == {"w", "k"} and len(plans) == 1
    for step in (2.0, 3.0):
        weights[0][1].fill_(step)                    # the trainer's step, in place in its shm
        again = serialize_named_tensors(weights)
        assert again == text
        assert refit.refit_from_serialized(model, [again], None, mapped) == report
        assert len(plans) == 1
        assert torch.equal(model.w, torch.full((4, 3), step))
    model.w.data = torch.zeros(4, 3)                 # new storage, same Parameter
    weights[0][1].fill_(4.0)
    refit.refit_from_serialized(model, [serialize_named_tensors(weights)], None, mapped)
    assert len(plans) == 2
    assert torch.equal(model.w, torch.full((4, 3), 4.0))
    assert torch.equal(model.qk[2:], torch.full((4, 3), 2.0))
    mapped.clear()                                   # what a sleep does first
    assert mapped.plan_of((text, None)) is None


class _Three(nn.Module):
    """Three parameters, one of them two checkpoint tensors (q, k) as the engine fuses qkv."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.qk = nn.Parameter(torch.zeros(6, 3), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(5), requires_grad=False)

    def weight_map(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        return {"w": (self.w, 0, 4), "q": (self.qk, 0, 2), "k": (self.qk, 2, 4),
                "b": (self.b, 0, 5)}

    def view(self, name: str) -> torch.Tensor:
        param, row0, rows = self.weight_map()[name]
        return param.data.narrow(0, row0, rows)


_SHAPES = {"w": (4, 3), "q": (2, 3), "k": (4, 3), "b": (5,)}
_SOURCES = {"A": ("w", "k"), "B": ("q", "b"), "C": ("w", "q", "k", "b")}


class RefitPlans(RuleBasedStateMachine):
    """Resent payloads, trainer steps in place, parameters given new storage (a shadow swap, a
    wake without backup), evictions from a small mapping: after every refit each weight holds
    exactly what the last payload naming it held when it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Three()
        # room for about one source's storages: sending another pushes older payloads out
        self.mapped = MappedStorages(4 * 4 * 30)
        self.trainer = {src: [(n, torch.randn(_SHAPES[n])) for n in names]
                        for src, names in _SOURCES.items()}
        self.expected = {n: torch.zeros(s) for n, s in _SHAPES.items()}

    @rule(src=st.sampled_from(sorted(_SOURCES)))
    def send(self, src: str) -> None:
        items = self.trainer[src]
        refit.refit_from_serialized(self.model, [serialize_named_tensors(items)], None,
                                    self.mapped)
        for name, tensor in items:
            self.expected[name] = tensor.clone()

    @rule(src=st.sampled_from(sorted(_SOURCES)), which=st.integers(0, 3), by=st.floats(-2, 2))
    def trainer_step(self, src: str, which: int, by: float) -> None:
        items = self.trainer[src]
        items[which % len(items)][1].add_(by)   # in place, in the trainer's shm

    @rule(param=st.sampled_from(["w", "qk", "b"]))
    def new_storage_same_values(self, param: str) -> None:
        p = getattr(self.model, param)
        p.data = p.data.clone()

    @rule()
    def wake_without_backup(self) -> None:
        self.mapped.clear()   # what rl_control does before the weights are released
        for p in self.model.parameters():
            p.data = torch.zeros_like(p.data)
        self.expected = {n: torch.zeros(s) for n, s in _SHAPES.items()}

    @invariant()
    def weights_are_the_last_sent(self) -> None:
        for name, value in self.expected.items():
            assert torch.equal(self.model.view(name), value), name


RefitPlans.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_refit_plans_state_machine = RefitPlans.TestCase
