"""A sync cut off halfway: the old weights keep serving bit for bit, and what the sync used (the
engine's receive buffer, the trainer's bucket buffers, the engine itself) is reusable: the next
full sync lands exactly on its weights and answers like a fresh engine.

    distributed: the trainer process dies in the middle of a call's broadcasts
    tensor:      a bucket whose buffer is shorter than its tensors (truncated)
    disk:        a checkpoint file cut short; a read that fails once writing has begun
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_engine.protocol.bucket import FlattenedBucket, plan_buckets
from rollout_engine.weights import disk_reader
from rollout_engine.weights.loader import iter_safetensors
from tests.trainer_bridge.conftest import PROBE, assert_same_rollouts, rollouts
from tests.trainer_bridge.test_weight_syncer import BUCKET, _engine_matches
from trainer_bridge import WeightSyncer
from trainer_bridge.bucketing import state_dict_items
from trainer_bridge.transports.group_ranks import free_port
from trainer_bridge.transports.tensor import TensorTransport

ROOT = Path(__file__).resolve().parents[2]

DYING_TRAINER = r"""
import os, sys
from rollout_engine.protocol.weight_broadcast import join_update_group
from rollout_engine.weights.loader import iter_safetensors
port, path, num_sent = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
group = join_update_group("127.0.0.1", port, 0, 2, "dying", "gloo", 60.0)
tensors = [t.contiguous() for _, t in iter_safetensors(path)]
for work in [group.broadcast(t) for t in tensors[:num_sent]]:
    work.wait()
os._exit(3)   # mid-sync: the engine still waits for the other tensors
"""


def _old_weights_serve(engine: Any, w1: Any) -> None:
    assert engine.get_weight_version() == "w1"
    assert _engine_matches(engine, w1.model)
    engine.flush_cache()
    assert_same_rollouts(rollouts(engine), w1.expected)


def _full_sync_lands(engine: Any, w2: Any, **syncer: Any) -> None:
    with WeightSyncer(engine, **syncer) as s:
        s.sync(w2.model, version="after")
    assert _engine_matches(engine, w2.model)
    assert_same_rollouts(rollouts(engine), w2.expected)
    engine.check_integrity()


def test_trainer_dying_mid_broadcast_leaves_the_old_weights(engine_on_w1, w1, w2):
    named = list(iter_safetensors(w2.path))
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, "-c", DYING_TRAINER, str(port), w2.path,
                                str(len(named) // 2)], env=env, cwd=ROOT)
    try:
        ok, message = engine_on_w1.init_weights_update_group(
            "127.0.0.1", port, 1, 2, group_name="dying", backend="gloo")
        assert ok, message
        ok, message = engine_on_w1.update_weights_from_distributed(
            names, dtypes, shapes, group_name="dying", weight_version="never")
        assert not ok
        assert trainer.wait(60) == 3
    finally:
        trainer.kill()
    _old_weights_serve(engine_on_w1, w1)
    ok, message = engine_on_w1.destroy_weights_update_group("dying")
    assert ok, message
    # a new group and the engine's receive buffer work: bucketed (several calls), then whole
    _full_sync_lands(engine_on_w1, w2, transport="distributed", bucket_bytes=BUCKET)
    _full_sync_lands(engine_on_w1, w1, transport="distributed", bucket_bytes=None)


def _truncated(bucket: FlattenedBucket, missing: int) -> FlattenedBucket:
    """`bucket` with its buffer `missing` bytes short (skipping the constructor's check, as a
    foreign trainer's pickle would)."""
    bad = object.__new__(FlattenedBucket)
    object.__setattr__(bad, "buffer", bucket.buffer[:-missing])
    object.__setattr__(bad, "metas", bucket.metas)
    return bad


@pytest.mark.parametrize("missing", [1, 4096])
def test_a_truncated_bucket_is_refused_and_the_buffers_stay_reusable(engine_on_w1, w1, w2,
                                                                     missing):
    with WeightSyncer(engine_on_w1, TensorTransport(BUCKET, pack=True)) as syncer:
        plan = next(iter(plan_buckets(state_dict_items(w2.model), BUCKET)))
        buffer = syncer.transport.buffers.slot(0, plan.num_bytes, torch.device("cpu"))
        bucket = plan.fill(buffer)
        ok, message = engine_on_w1.update_weights_from_tensor(
            [_truncated(bucket, missing)], load_format="flattened_bucket",
            weight_version="never")
        assert not ok and "truncated bucket" in message, message
        _old_weights_serve(engine_on_w1, w1)
        kept = [b.data_ptr() for b in syncer.transport.buffers.buffers()]
        syncer.sync(w2.model, version="after")
        assert [b.data_ptr() for b in syncer.transport.buffers.buffers()][:1] == kept
    assert _engine_matches(engine_on_w1, w2.model)
    assert_same_rollouts(rollouts(engine_on_w1), w2.expected)


def test_a_checkpoint_cut_short_is_refused_before_any_write(engine_on_w1, w1, w2, tmp_path):
    data = Path(w2.path, "model.safetensors").read_bytes()
    for name in os.listdir(w2.path):
        if not name.endswith(".safetensors"):
            (tmp_path / name).write_bytes(Path(w2.path, name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(data[:-1000])
    ok, message = engine_on_w1.update_weights_from_disk(str(tmp_path), weight_version="never")
    assert not ok and "truncated" in message, message
    _old_weights_serve(engine_on_w1, w1)
    _full_sync_lands(engine_on_w1, w2, transport="disk")


def test_a_read_failing_midway_marks_the_weights_unwritten(monkeypatch, w1_w2):
    """Once reading has begun, a failure cannot be undone: the engine refuses to generate until
    every weight the read may have touched is written again, then serves the new weights."""
    from rollout_engine import Engine

    engine = Engine(model_path=w1_w2[0], dtype="float32", device="cpu", scheduler_mode="thread")
    try:
        calls = {"n": 0}
        real = os.preadv

        def failing(fd: int, buffers: Any, offset: int) -> int:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(5, "Input/output error")
            return real(fd, buffers, offset)

        monkeypatch.setattr(disk_reader.os, "preadv", failing)
        monkeypatch.setattr(disk_reader, "NUM_THREADS", 1)
        ok, message = engine.update_weights_from_disk(w1_w2[1], weight_version="broken")
        assert not ok and "Input/output error" in message, message
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "stale" in out["meta_info"]["finish_reason"]["message"]
        monkeypatch.setattr(disk_reader.os, "preadv", real)
        ok, message = engine.update_weights_from_disk(w1_w2[1], weight_version="w2")
        assert ok, message
        fresh = Engine(model_path=w1_w2[1], dtype="float32", device="cpu",
                       scheduler_mode="thread")
        try:
            assert engine.get_weights_by_name(PROBE, 8) == fresh.get_weights_by_name(PROBE, 8)
            greedy = {"max_new_tokens": 6, "temperature": 0.0}
            assert (engine.generate(input_ids=[1, 2, 3], sampling_params=greedy)["output_ids"]
                    == fresh.generate(input_ids=[1, 2, 3], sampling_params=greedy)["output_ids"])
        finally:
            fresh.shutdown()
    finally:
        engine.shutdown()
