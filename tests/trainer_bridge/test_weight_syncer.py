"""WeightSyncer over every transport: an engine on W1 synced from a transformers model on W2
answers like a fresh W2 engine: the same weights bit for bit, the same greedy tokens, and
logprobs within LOGPROB_TOL (see conftest)."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.trainer_bridge.conftest import PROBE, assert_same_rollouts, rollouts
from trainer_bridge import WeightSyncer
from trainer_bridge.bucketing import nbytes, state_dict_items
from trainer_bridge.transports import WeightSyncError
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport, handle_groups

BUCKET = 64 << 10  # the tiny model is ~420 KB: several buckets


def PACKED() -> TensorTransport:  # noqa: N802 - reads as a constant at the call sites
    """CPU buckets packed into the reused shared buffers (CPU default: groups of handles)."""
    return TensorTransport(BUCKET, pack=True)


def PACKED_BROADCAST() -> DistributedTransport:  # noqa: N802
    """Gloo buckets packed into one flattened broadcast each (CPU default: a call of
    per-tensor broadcasts)."""
    return DistributedTransport(bucket_bytes=BUCKET, pack=True)


class Recorder:
    """Wraps an engine and records the weight updates it is asked for."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.updates: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if not name.startswith("update_weights_from"):
            return attr

        def record(*args: Any, **kwargs: Any) -> Any:
            self.updates.append({"method": name, **kwargs})
            return attr(*args, **kwargs)
        return record


@pytest.mark.parametrize("transport,bucket_bytes", [
    ("tensor", None), ("tensor", BUCKET), ("tensor-packed", BUCKET), ("distributed", None),
    ("distributed", BUCKET), ("distributed-packed", BUCKET), ("disk", None)])
def test_sync_makes_a_w1_engine_answer_like_w2(engine_on_w1, w2, transport, bucket_bytes):
    engine = Recorder(engine_on_w1)
    payload = nbytes(state_dict_items(w2.model))
    chosen: Any = {"tensor-packed": PACKED, "distributed-packed": PACKED_BROADCAST}.get(
        transport, lambda: transport)()
    packed = transport.endswith("-packed")
    transport = transport.removesuffix("-packed")
    with WeightSyncer(engine, transport=chosen, bucket_bytes=bucket_bytes) as syncer:
        report = syncer.sync(w2.model, version="step-1")
        rows = rollouts(engine_on_w1)
        assert_same_rollouts(rows, w2.expected)
        assert {v for _, _, v in rows} == {"step-1"}
        assert engine_on_w1.get_weights_by_name(PROBE, 4) == w2.probe
        assert engine_on_w1.get_weight_version() == "step-1"

        assert report.version == "step-1" and report.num_engines == 1
        assert report.transport == transport
        # buckets add at most 15 alignment bytes per tensor
        num_tensors = len(list(state_dict_items(w2.model)))
        assert payload <= report.bytes <= payload + 15 * num_tensors
        assert report.seconds > 0
        assert report.gbps == pytest.approx(report.bytes / report.seconds / 1e9)
        # one engine call per bucket; only the last one names the final version
        versions = [u["weight_version"] for u in engine.updates]
        assert versions[-1] == "step-1"
        if bucket_bytes is None:
            assert len(versions) == 1
        else:
            assert len(versions) >= payload // BUCKET
            assert versions[:-1] == [f"step-1.partial{i}" for i in range(len(versions) - 1)]
            assert [u["flush_cache"] for u in engine.updates] == [False] * (
                len(versions) - 1) + [True]
        if transport in ("tensor", "distributed") and bucket_bytes is not None:
            # on CPU a bucket is a call of tensors (handles / per-tensor broadcasts), unless
            # packed into one flattened buffer
            assert {u["load_format"] for u in engine.updates} == {
                "flattened_bucket" if packed else None}
        # a version of None: the syncer picks one past an integer version and names it in
        # every engine call (engines, like SGLang, keep their version when none is named)
        engine_on_w1.update_weight_version("41")
        engine.updates.clear()
        assert syncer.sync(w2.model).version == "42" == engine_on_w1.get_weight_version()
        assert engine.updates and all(isinstance(u["weight_version"], str)
                                      for u in engine.updates)
        assert engine.updates[-1]["weight_version"] == "42"
    engine_on_w1.check_integrity()


def test_a_rejected_update_changes_nothing(engine_on_w1, w1, w2):
    """A bad tensor is refused as a whole; the group survives (the engine drained the
    broadcast) and the next sync works."""
    bad = [(n, torch.zeros(3, 3) if n == PROBE else t) for n, t in state_dict_items(w2.model)]
    with WeightSyncer(engine_on_w1, transport="distributed", bucket_bytes=None) as syncer:
        with pytest.raises(WeightSyncError, match="shape"):
            syncer.sync(bad, version="bad")
        assert engine_on_w1.get_weights_by_name(PROBE, 4) == w1.probe
        engine_on_w1.flush_cache()  # the failed call left the cache alone, as it should
        assert_same_rollouts(rollouts(engine_on_w1), w1.expected)
        assert engine_on_w1.get_weight_version() == "w1"
        syncer.sync(w2.model, version="good")
        assert_same_rollouts(rollouts(engine_on_w1), w2.expected)
    with pytest.raises(WeightSyncError, match="unknown weight name"):
        WeightSyncer(engine_on_w1, "tensor").sync([("nope", torch.zeros(1))], "bad")
    assert engine_on_w1.get_weight_version() == "good"


def test_two_engines_are_synced_at_once(engine_on_w1, second_engine, w1, w2):
    engines = [engine_on_w1, second_engine]
    with WeightSyncer(engines, transport="distributed", bucket_bytes=BUCKET) as syncer:
        assert syncer.transport.world_size == 3
        report = syncer.sync(w1.model, version="both-w1")
        assert report.num_engines == 2
        for e in engines:
            assert_same_rollouts(rollouts(e), w1.expected)
            assert e.get_weights_by_name(PROBE, 4) == w1.probe
        syncer.sync(w2.model, version="both-w2")
        for e in engines:
            assert_same_rollouts(rollouts(e), w2.expected)
            assert e.get_weight_version() == "both-w2"
    # close() destroyed the group on both engines: the name is free again
    for e in engines:
        ok, message = e.destroy_weights_update_group("weight_update_group")
        assert not ok and "no weight update group" in message
    with WeightSyncer(engines, transport="distributed", bucket_bytes=None) as syncer:
        syncer.sync(w2.model, version="again")
    assert second_engine.get_weight_version() == "again"


def test_bad_arguments_are_refused(engine_on_w1):
    with pytest.raises(ValueError, match="transport"):
        WeightSyncer(engine_on_w1, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightSyncer(engine_on_w1, transport="tensor", bucket_bytes=0)
    with pytest.raises(ValueError, match="backend"):
        WeightSyncer(engine_on_w1, transport="distributed", backend="mpi")
    with pytest.raises(ValueError, match="engines"):
        WeightSyncer([], transport="tensor")
    syncer = WeightSyncer(engine_on_w1, transport="tensor")
    with pytest.raises(ValueError, match="version"):
        syncer.sync([], version="")
    syncer.close()
    with pytest.raises(RuntimeError, match="closed"):
        syncer.sync([], version="x")


def test_an_engine_refusing_the_group_fails_fast(engine_on_w1, w2):
    """init_weights_update_group blocks until all ranks join; a refusal must not leave the
    trainer waiting for the gloo timeout."""
    with WeightSyncer(engine_on_w1, transport="distributed") as first:
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="already exists"):
            WeightSyncer(engine_on_w1, transport="distributed")
        assert time.monotonic() - start < 30
        first.sync(w2.model, version="still-works")  # the first group is untouched
    assert engine_on_w1.get_weight_version() == "still-works"


def _engine_matches(engine: Any, model: Any) -> bool:
    """Every weight the engine reports (up to 1024 rows each) equals the trainer's, bit for
    bit (fp32 values round-trip exactly through Python floats)."""
    return all(engine.get_weights_by_name(name, min(len(t), 1024)) == t[:1024].tolist()
               for name, t in state_dict_items(model))


def _shm_path(buffer: torch.Tensor) -> str:
    _manager, handle, _size = buffer.untyped_storage()._share_filename_cpu_()
    return os.path.join("/dev/shm", handle.decode().lstrip("/"))


def test_bucketed_syncs_reuse_two_shared_buffers_and_free_them_on_close(engine_on_w1, w1, w2):
    """W1 -> W2 -> W1 through the same reused bucket buffers lands exactly on the last weights
    (no stale bytes of an earlier bucket or sync); close() frees the buffers."""
    with WeightSyncer(engine_on_w1, PACKED()) as syncer:
        syncer.sync(w2.model, version="w2")
        buffers = syncer.transport.buffers.buffers()
        assert len(buffers) == 2                     # alternating slots, not one per bucket
        first = [b.data_ptr() for b in buffers]
        assert _engine_matches(engine_on_w1, w2.model)
        syncer.sync(w1.model, version="w1-again")
        assert [b.data_ptr() for b in syncer.transport.buffers.buffers()] == first
        assert engine_on_w1.get_weights_by_name(PROBE, 4) == w1.probe
        assert _engine_matches(engine_on_w1, w1.model)
        assert not _engine_matches(engine_on_w1, w2.model)
        assert_same_rollouts(rollouts(engine_on_w1), w1.expected)
        paths = [_shm_path(b) for b in buffers]
        assert all(os.path.exists(p) for p in paths)
        refs = [StorageWeakRef(b.untyped_storage()) for b in buffers]
        del buffers
    assert syncer.transport.buffers.num_bytes == 0
    gc.collect()
    assert all(r.expired() for r in refs)            # the trainer holds no bucket memory
    # the engine keeps recent shm mapped, up to twice the model's bytes: three refits from
    # fresh copies of the weights push the buffers out and their shared-memory files are gone
    with WeightSyncer(engine_on_w1, transport="tensor", bucket_bytes=None) as syncer:
        for i in range(3):
            syncer.sync([(n, t.clone()) for n, t in state_dict_items(w1.model)], f"copy-{i}")
    assert not any(os.path.exists(p) for p in paths)


def test_a_bucket_refused_mid_pipeline_leaves_the_buffers_reusable(engine_on_w1, w1, w2):
    """A bucket the engine refuses (its next bucket already packed) raises; no later bucket is
    sent, the buffers are kept, and the next sync through them lands exactly on its weights."""
    bad = [(n, torch.zeros(3, 3) if n == PROBE else t) for n, t in state_dict_items(w2.model)]
    engine = Recorder(engine_on_w1)
    with WeightSyncer(engine, PACKED()) as syncer:
        num_buckets = len(list(syncer.transport.plan(bad)))
        with pytest.raises(WeightSyncError, match="shape"):
            syncer.sync(bad, version="bad")
        assert 1 <= len(engine.updates) < num_buckets     # stopped at the refused bucket
        assert engine_on_w1.get_weights_by_name(PROBE, 4) == w1.probe
        assert len(syncer.transport.buffers.buffers()) == 2
        kept = [b.data_ptr() for b in syncer.transport.buffers.buffers()]
        syncer.sync(w1.model, version="w1-after-refusal")
        assert [b.data_ptr() for b in syncer.transport.buffers.buffers()] == kept
        assert _engine_matches(engine_on_w1, w1.model)
        assert_same_rollouts(rollouts(engine_on_w1), w1.expected)


def _mapped_by(pid: int, path: str) -> bool:
    """Whether process `pid` maps the shm file at `path` (named still, or unlinked)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(path in line for line in f)


def test_releasing_the_weights_unmaps_the_trainers_shared_memory(engine_on_w1, w1, w2):
    """The engine keeps resent shm mapped across refits, but a sleeping engine maps none. Its
    mapping holds no reference of the trainer's: the files are unlinked as soon as the trainer
    lets go of them, and only the memory stays mapped until the release."""
    with WeightSyncer(engine_on_w1, PACKED()) as syncer:
        syncer.sync(w2.model, version="w2")
        paths = [_shm_path(b) for b in syncer.transport.buffers.buffers()]
    gc.collect()
    scheduler = engine_on_w1.tm.host.pid
    assert scheduler != os.getpid()                  # the engine reads from another process
    assert all(_mapped_by(scheduler, p) for p in paths)   # still mapped by the engine
    assert not any(os.path.exists(p) for p in paths)      # ... but no name is left
    engine_on_w1.release_memory_occupation(["weights"])
    assert not any(_mapped_by(scheduler, p) for p in paths)
    engine_on_w1.resume_memory_occupation(["weights"])
    ok, message = engine_on_w1.update_weights_from_disk(w1.path, weight_version="w1")
    assert ok, message
    assert _engine_matches(engine_on_w1, w1.model)


def test_cpu_buckets_are_groups_of_handles_not_packed_copies(engine_on_w1, w2):
    """On CPU a bucket is a bounded group of shared-memory handles: one call per group, each
    tensor sent as itself (no packing copy, no bucket buffers), the last call flushing."""
    engine = Recorder(engine_on_w1)
    items = list(state_dict_items(w2.model))
    groups = handle_groups(items, BUCKET)
    assert len(groups) > 2
    assert all(nbytes(g) <= BUCKET for g in groups if len(g) > 1)
    with WeightSyncer(engine, transport="tensor", bucket_bytes=BUCKET) as syncer:
        syncer.sync(w2.model, version="groups")
        assert syncer.transport.buffers.num_bytes == 0
    assert len(engine.updates) == len(groups)
    assert {u["load_format"] for u in engine.updates} == {None}
    assert [u["flush_cache"] for u in engine.updates] == [False] * (len(groups) - 1) + [True]
    assert engine.updates[-1]["weight_version"] == "groups"
    assert all(t.is_shared() for _, t in items)       # the trainer's own memory was sent
    assert _engine_matches(engine_on_w1, w2.model)
    assert_same_rollouts(rollouts(engine_on_w1), w2.expected)


def test_handle_groups_bound_their_bytes_and_keep_order():
    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    groups = handle_groups(items, 100)        # bytes: 40 40 120 20 400 4
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4"],
                                                   ["t5"]]
    assert [n for g in groups for n, _ in g] == [n for n, _ in items]
    with pytest.raises(ValueError, match="pack"):
        TensorTransport(BUCKET, pack="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("bucket_bytes", [None, 1 << 16])
def test_a_trainer_whose_weights_view_one_flat_buffer_refits_again_and_again(
        engine_on_w1, w2, bucket_bytes):
    """Parameters that are views of one flat buffer (FSDP / DeepSpeed flat parameters), in the
    colocated loop (sleep, train, wake, refit): every refit sends one storage under many
    names; the engine must drop one shm reference per read, not one per view, or its
    unmapping at the next sleep unlinks the file under the trainer and the refit after the
    wake fails ("does not exist"), or, with more views than references, the count never
    returns to zero and the file outlives everyone."""
    import copy

    trainer = copy.deepcopy(w2.model)
    params = list(trainer.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    with torch.no_grad():
        offset = 0
        for p in params:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += p.numel()
    with WeightSyncer(engine_on_w1, transport="tensor", bucket_bytes=bucket_bytes) as syncer:
        for step in range(3):
            engine_on_w1.release_memory_occupation(["weights"])   # sleep: unmaps the shm
            with torch.no_grad():
                flat.mul_(1.0 - 2.0 ** -10)   # an optimizer step, in place
            engine_on_w1.resume_memory_occupation(["weights"])
            syncer.sync(trainer, version=f"flat-{step}")
            assert _engine_matches(engine_on_w1, trainer), step
    path = _shm_path(flat)
    assert os.path.exists(path)
    engine_on_w1.release_memory_occupation(["weights"])   # the engine unmaps it
    engine_on_w1.resume_memory_occupation(["weights"])
    del trainer, params, p, view, flat
    gc.collect()
    assert not os.path.exists(path)   # the last reference was the trainer's
