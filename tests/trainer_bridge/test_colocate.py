"""engine_sleeping: release on enter, resume + refit on exit, always wake."""

from __future__ import annotations

import pytest

from tests.trainer_bridge.conftest import PROBE, assert_same_rollouts, rollouts
from trainer_bridge import WeightSyncer, engine_sleeping


def test_sleep_wake_refit_cycles(engine_on_w1, w1, w2):
    with WeightSyncer(engine_on_w1, transport="tensor", bucket_bytes=128 << 10) as syncer:
        for step, weights in enumerate([w2, w1, w2]):
            awake = engine_on_w1.get_server_info()
            with engine_sleeping(engine_on_w1, syncer, weights.model,
                                 version=f"step-{step}") as report:
                info = engine_on_w1.get_server_info()
                assert set(info["released_memory"]) == {"weights", "kv_cache", "cuda_graph"}
                with pytest.raises(Exception, match="asleep"):
                    engine_on_w1.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
            assert report.bytes_freed >= awake["kv_pool_bytes"] + awake["weight_bytes"] > 0
            assert report.release_seconds > 0 and report.resume_seconds > 0
            assert report.refit_seconds >= report.sync.seconds > 0
            assert report.sync.version == f"step-{step}"
            assert engine_on_w1.get_server_info()["released_memory"] == []
            assert_same_rollouts(rollouts(engine_on_w1), weights.expected)
            assert engine_on_w1.get_weights_by_name(PROBE, 4) == weights.probe
            engine_on_w1.check_integrity()


def test_wakes_without_refit_when_the_body_fails(engine_on_w1, w1):
    syncer = WeightSyncer(engine_on_w1, transport="tensor")
    with pytest.raises(RuntimeError, match="train step failed"):
        with engine_sleeping(engine_on_w1, syncer, w1.model, tags=["kv_cache"],
                             version="never") as report:
            raise RuntimeError("train step failed")
    assert report.sync is None and report.refit_seconds == 0.0
    assert engine_on_w1.get_server_info()["released_memory"] == []
    assert engine_on_w1.get_weight_version() == "w1"
    engine_on_w1.flush_cache()
    assert_same_rollouts(rollouts(engine_on_w1), w1.expected)


def test_sleeping_without_refit_keeps_kv_only_sleep_servable(engine_on_w1, w1):
    with engine_sleeping(engine_on_w1, tags=["kv_cache"]) as report:
        pass
    assert report.sync is None and report.bytes_freed > 0
    assert_same_rollouts(rollouts(engine_on_w1), w1.expected)
    with pytest.raises(ValueError, match="both"):
        with engine_sleeping(engine_on_w1, model=w1.model):
            pass
