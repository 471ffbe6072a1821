"""RolloutFleet over two tiny engines: one broadcast refits both to W2 (each then answers like
a fresh W2 engine), sleep / wake / pause fan out, and an engine killed in the middle of a
refit gives a FleetRefitError within the timeout with every engine's version, the survivor
quarantined (refusing generation) until the next refit lands."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.trainer_bridge.conftest import PROBE, assert_same_rollouts, rollouts
from tests.trainer_bridge.test_client_live import client_rollouts, served  # noqa: F401
from trainer_bridge import FleetError, FleetRefitError, RolloutFleet
from trainer_bridge.bucketing import nbytes, state_dict_items

BUCKET = 64 << 10   # several buckets of the ~420 KB tiny model
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def peer(w1_w2: tuple[str, str]) -> Iterator[Any]:
    """A second engine (thread-mode: half the start-up) beside the shared process engine."""
    from rollout_engine import Engine

    eng = Engine(model_path=w1_w2[0], dtype="float32", device="cpu", scheduler_mode="thread",
                 weight_update_group_timeout=TIMEOUT_S)
    try:
        yield eng
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.fixture
def peer_on_w1(peer: Any, w1: Any) -> Any:
    peer.resume_memory_occupation(None)   # a failed test may have left it quarantined
    peer.continue_generation()
    ok, message = peer.update_weights_from_disk(w1.path, weight_version="w1")
    assert ok, message
    return peer


@pytest.mark.parametrize("transport,bucket_bytes", [
    ("distributed", None), ("distributed", BUCKET), ("tensor", BUCKET), ("disk", None)])
def test_one_broadcast_refits_every_engine(engine_on_w1, peer_on_w1, w2, transport,
                                           bucket_bytes):
    engines = [engine_on_w1, peer_on_w1]
    with RolloutFleet(engines, transport=transport, bucket_bytes=bucket_bytes,
                      timeout_s=TIMEOUT_S) as fleet:
        report = fleet.refit(w2.model, version="step-1")
        assert report.ok and report.versions == {0: "step-1", 1: "step-1"}
        # the trainer's bytes once for the whole fleet, not once per engine
        payload = nbytes(state_dict_items(w2.model))
        assert payload <= report.bytes <= payload + 15 * len(list(state_dict_items(w2.model)))
        assert fleet.weight_versions().versions == {0: "step-1", 1: "step-1"}
    for e in engines:
        assert e.get_weights_by_name(PROBE, 4) == w2.probe
        rows = rollouts(e)
        assert_same_rollouts(rows, w2.expected)
        assert {v for _, _, v in rows} == {"step-1"}


def test_sleep_wake_pause_fan_out(engine_on_w1, peer_on_w1, w2):
    from rollout_engine.tokenizer_manager import EngineAsleepError

    engines = [engine_on_w1, peer_on_w1]
    with RolloutFleet(engines, timeout_s=TIMEOUT_S) as fleet:
        assert fleet.pause("retract").ok
        report = fleet.sleep()
        assert [r.index for r in report.engines] == [0, 1]
        assert all(r.answer["bytes_freed"] > 0 for r in report.engines)
        for e in engines:
            with pytest.raises(EngineAsleepError):
                e.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
        fleet.wake()          # weights are zeros now: stale until the refit
        fleet.continue_generation()
        fleet.refit(w2.model, version="after-sleep")
    for e in engines:
        assert_same_rollouts(rollouts(e), w2.expected)
        e.check_integrity()


def test_a_fleet_of_a_server_and_a_data_parallel_engine(served, engine_on_w1, w1_w2,  # noqa: F811
                                                        w2):
    """One broadcast to a server (through RolloutClient) and a --dp-size 2 engine: the group
    has 1 + 1 + 2 ranks, every rank lands on W2."""
    from rollout_engine import Engine

    client, _ = served
    dp2 = Engine(model_path=w1_w2[0], dtype="float32", device="cpu", scheduler_mode="thread",
                 dp_size=2, weight_update_group_timeout=TIMEOUT_S)
    try:
        with RolloutFleet([client, dp2], bucket_bytes=BUCKET, timeout_s=TIMEOUT_S) as fleet:
            report = fleet.refit(w2.model, version="fleet-dp")
            assert report.versions == {0: "fleet-dp", 1: "fleet-dp"}
            assert fleet.syncer is not None and fleet.syncer.transport.world_size == 4
        assert_same_rollouts(client_rollouts(client), w2.expected)
        assert_same_rollouts(rollouts(dp2), w2.expected)
        assert [r["weight_version"] for r in dp2.get_server_info()["dp_results"]] == [
            "fleet-dp", "fleet-dp"]
        dp2.check_integrity()
    finally:
        dp2.shutdown()


class Hung:
    """An engine whose calls block until `release` is set (a wedged server)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def release_memory_occupation(self, tags: Any = None) -> dict[str, Any]:
        self.release.wait()
        return {"bytes_freed": 0}

    def get_weight_version(self) -> str:
        self.release.wait()
        return "w1"


class Quick:
    def release_memory_occupation(self, tags: Any = None) -> dict[str, Any]:
        return {"bytes_freed": 7}


def test_a_hung_engine_is_reported_within_the_timeout():
    hung = Hung()
    fleet = RolloutFleet([Quick(), hung], timeout_s=0.5)
    try:
        start = time.perf_counter()
        with pytest.raises(FleetError, match="engine 1: sleep did not answer within 0.5 s") \
                as caught:
            fleet.sleep()
        assert time.perf_counter() - start < 5
        quick, stuck = caught.value.report.engines
        assert quick.ok and quick.answer == {"bytes_freed": 7} and not stuck.ok
        assert fleet.weight_versions().versions == {0: None, 1: None}   # neither answers
    finally:
        hung.release.set()
        fleet.close()


def test_bad_arguments_name_the_field(peer_on_w1):
    with pytest.raises(ValueError, match="engines"):
        RolloutFleet([])
    with pytest.raises(ValueError, match="transport"):
        RolloutFleet([peer_on_w1], transport="carrier-pigeon")
    with pytest.raises(ValueError, match="timeout_s"):
        RolloutFleet([peer_on_w1], timeout_s=0)
    with RolloutFleet([peer_on_w1]) as fleet, pytest.raises(ValueError, match="version"):
        fleet.refit([], version="")


class KilledOnBucket:
    """A process-mode engine whose scheduler is SIGKILLed when bucket `at` of a broadcast
    refit reaches it: it dies with the earlier buckets applied and the rest in flight."""

    def __init__(self, engine: Any, at: int) -> None:
        self.engine, self.at, self.calls = engine, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls == self.at:
            os.kill(self.engine.tm.host.pid, signal.SIGKILL)
        self.calls += 1
        return self.engine.update_weights_from_distributed(*args, **kwargs)


def _victim(w1_w2: tuple[str, str]) -> Any:
    from rollout_engine import Engine

    return Engine(model_path=w1_w2[0], dtype="float32", device="cpu",
                  weight_update_group_timeout=TIMEOUT_S)


def test_an_engine_killed_mid_refit_is_reported_and_none_serves_mixed(
        peer_on_w1, w1_w2, w2):
    from rollout_engine.tokenizer_manager import EngineAsleepError

    victim = _victim(w1_w2)
    try:
        fleet = RolloutFleet([peer_on_w1, KilledOnBucket(victim, at=2)], bucket_bytes=BUCKET,
                             timeout_s=TIMEOUT_S)
        start = time.perf_counter()
        with pytest.raises(FleetRefitError) as caught:
            fleet.refit(w2.model, version="step-2")
        assert time.perf_counter() - start < 3 * TIMEOUT_S
        report = caught.value.report
        survivor, dead = report.engines
        assert dead.index == 1 and not dead.ok and dead.version is None
        # the survivor holds some buckets of step-2: never served, quarantined instead
        assert survivor.version != "step-2" and survivor.version.startswith("step-2.partial")
        assert survivor.quarantined and not survivor.ok
        assert "engine 1: unreachable" in str(caught.value)
        with pytest.raises(EngineAsleepError):
            peer_on_w1.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})

        # the next refit wakes the survivor and refits it over a group without the dead one
        again = fleet.refit(w2.model, version="step-3")
        assert again.versions == {0: "step-3"}
        assert_same_rollouts(rollouts(peer_on_w1), w2.expected)
        fleet.close()
    finally:
        victim.shutdown()


class LosesAnswer:
    """An engine whose first update answer is lost on the way back (the update itself lands)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> Any:
        answer = self.engine.update_weights_from_distributed(*args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("the link to the engine dropped")
        return answer


def test_a_group_whose_first_destroy_is_refused_as_busy_is_destroyed_before_the_next_refit(
        peer_on_w1, w2, monkeypatch):
    """After a failed broadcast an engine may still be receiving a cut-off update when the
    fleet tears the group down, and refuses that destroy (as busy); the fleet destroys the
    group once the engine answers, so the next refit's group is not refused as existing."""
    from rollout_engine.protocol.messages import BusyError
    from rollout_engine.weights.update_groups import WeightUpdateGroups

    destroy, refused = WeightUpdateGroups.destroy, []

    def busy_once(self: WeightUpdateGroups, group_name: str) -> None:
        if not refused:
            refused.append(group_name)
            raise BusyError("a weight update is being received")
        destroy(self, group_name)
    monkeypatch.setattr(WeightUpdateGroups, "destroy", busy_once)

    fleet = RolloutFleet([LosesAnswer(peer_on_w1)], timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(FleetRefitError, match="the link to the engine dropped") as caught:
            fleet.refit(w2.model, version="step-2")
        assert refused == ["weight_update_group"]
        assert caught.value.report.versions == {0: "step-2"}   # it landed; only the answer was lost

        again = fleet.refit(w2.model, version="step-3")
        assert again.versions == {0: "step-3"}
        assert_same_rollouts(rollouts(peer_on_w1), w2.expected)
    finally:
        fleet.close()
