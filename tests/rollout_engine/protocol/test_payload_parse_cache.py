"""Repeated tensor payloads (a trainer whose weights stay in shared memory sends the same
string every refit) skip parsing, but never the checks a storage must pass to be opened."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.protocol import tensor_handles, tensor_payload
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.protocol.tensor_payload import UnsafePayloadError, deserialize_named_tensors


@pytest.fixture
def parses(monkeypatch):
    """Counts the restricted unpickler's runs."""
    count = []
    real = tensor_payload.RestrictedUnpickler

    class Counting(real):  # type: ignore[misc, valid-type]
        def load(self):
            count.append(1)
            return super().load()

    monkeypatch.setattr(tensor_payload, "RestrictedUnpickler", Counting)
    monkeypatch.setattr(tensor_payload, "_PARSED", tensor_payload.ParsedPayloads())
    return count


def test_a_repeat_is_parsed_once_and_reads_the_current_values(parses):
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3))]
    first = serialize_named_tensors(weights)
    out1 = deserialize_named_tensors(first)
    weights[0][1].mul_(10)                       # the trainer's optimizer step, in place
    second = serialize_named_tensors(weights)
    assert second == first                       # same storages: the same string
    out2 = deserialize_named_tensors(second)
    assert len(parses) == 1
    assert torch.equal(out2[0][1], torch.arange(6.0) * 10)
    assert torch.equal(out1[1][1], out2[1][1])
    assert out2[0][1].data_ptr() == weights[0][1].data_ptr()   # still the sender's memory


def test_another_cap_parses_again_and_is_enforced(parses):
    weights = [("w", torch.zeros(256))]   # 1 KiB
    payload = serialize_named_tensors(weights)
    deserialize_named_tensors(payload)
    with pytest.raises(UnsafePayloadError, match="over this receiver's cap of 512"):
        deserialize_named_tensors(payload, max_bytes=512)
    assert len(parses) == 2


def test_a_cached_payload_whose_shm_file_shrank_is_refused(parses, monkeypatch):
    """The shm file's size is read again on a hit: mapping past its end would fault. (The
    file is not really truncated: this process maps it, and a shrunk mapping faults.)"""
    victim = torch.zeros(1024)
    payload = serialize_named_tensors([("w", victim)])
    deserialize_named_tensors(payload)
    monkeypatch.setattr(tensor_handles, "shm_file_bytes", lambda handle, what: 16)
    with pytest.raises(UnsafePayloadError, match="holds 16; opening it would grow it"):
        deserialize_named_tensors(payload)
    assert len(parses) == 1


def test_refused_payloads_are_not_cached(parses):
    payload = serialize_named_tensors([("w", torch.zeros(256))])
    for _ in range(2):
        with pytest.raises(UnsafePayloadError):
            deserialize_named_tensors(payload, max_bytes=8)
    assert len(parses) == 2


def test_the_cache_is_bounded(parses):
    keep = [torch.full((4,), float(i)) for i in range(tensor_payload.ParsedPayloads.SIZE + 3)]
    for i, t in enumerate(keep):
        deserialize_named_tensors(serialize_named_tensors([(f"w{i}", t)]))
    assert len(tensor_payload._PARSED._trees) == tensor_payload.ParsedPayloads.SIZE
