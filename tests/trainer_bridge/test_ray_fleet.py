"""RayRolloutFleet on a local Ray (2 CPUs) with two tiny engines, each a Ray actor in its own
bundle of one placement group: `generate` keeps a GRPO group on the engine holding its prefix
(`cached_tokens`), one broadcast refits both (each then answers like a fresh engine on the new
weights), sleep / wake / pause fan out with per-engine results, and an engine whose actor is
killed in the middle of a refit gives a FleetRefitError within the timeout, the survivor
quarantined until the next refit lands.

One Ray session and one fleet for the module (starting them is most of its time); the kill
test runs last, as it takes an engine away.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tests.trainer_bridge.conftest import (
    PROBE,
    _load_hf,
    assert_same_rollouts,
    rollouts,
    tokens_and_logprobs,
)
from trainer_bridge import FleetRefitError, RolloutFleet
from trainer_bridge.bucketing import nbytes, state_dict_items
from trainer_bridge.ray import LOCAL_ONLY_ENV, RayFleetConfig, RayRolloutFleet, start_local_ray

os.environ.setdefault(LOCAL_ONLY_ENV, "0")   # read as ray is imported: Ray on 127.0.0.1 only
import ray  # noqa: E402 - CI installs the ray extra (dev)

pytestmark = pytest.mark.ray

BUCKET = 64 << 10   # several buckets of the ~420 KB tiny model: a refit is several calls
TIMEOUT_S = 10.0
GROUP_A = list(range(100, 148))   # 48 tokens: 3 dispatcher blocks
GROUP_B = list(range(200, 240))   # 40 tokens: 2 blocks (its length tells its outputs apart)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    start_local_ray(num_cpus=2, temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(ray_session: None, w1_w2: tuple[str, str]) -> Iterator[RayRolloutFleet]:
    f = RayRolloutFleet({"model_path": w1_w2[0], "dtype": "float32",
                         "weight_update_group_timeout": TIMEOUT_S},
                        RayFleetConfig(num_engines=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S))
    try:
        yield f
    finally:
        f.shutdown()


@pytest.fixture(scope="module")
def fresh_w1(fleet: RayRolloutFleet) -> list[Any]:
    """What a fresh W1 engine answers: engine 0 before any refit (every test that refits asks
    for it, so it is taken first whatever runs)."""
    return tokens_and_logprobs(rollouts(fleet.engines[0]))


def test_engines_are_actors_in_their_own_bundles(fleet, fresh_w1):
    group_id = fleet.placement_group.id.hex()
    assert len({info["pid"] for info in fleet.infos}) == 2
    for info in fleet.infos:
        assert info["placement_group_id"] == group_id and info["device"] == "cpu"
        assert info["scheduler_pid"] not in (None, info["pid"])   # a child process
        assert info["resources"] == {"CPU": 1.0}
    table = ray.util.placement_group_table(fleet.placement_group)
    assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
    # each bundle's CPU (Ray's "CPU_group_<i>_<group>") is held by one engine actor
    for i in range(2):
        assert ray.cluster_resources()[f"CPU_group_{i}_{group_id}"] == 1.0
        assert ray.available_resources().get(f"CPU_group_{i}_{group_id}", 0.0) == 0.0
    assert fleet.weight_versions().versions == {0: "default", 1: "default"}
    assert_same_rollouts(rollouts(fleet.engines[1]), fresh_w1)


def _group_round(fleet: RayRolloutFleet, order: list[list[int]], seed: int) -> dict[int, Any]:
    """One call with each group's prompt, n=4: prompt length -> [(engine, cached_tokens)]."""
    outs = fleet.generate(input_ids=order, sampling_params={
        "n": 4, "max_new_tokens": 3, "temperature": 1.0, "sampling_seed": seed})
    assert len(outs) == 4 * len(order)
    placed: dict[int, Any] = {}
    for k, out in enumerate(outs):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(order[k // 4])   # prompt-major, like the Engine
        placed.setdefault(meta["prompt_tokens"], []).append(
            (meta["engine_index"], meta["cached_tokens"]))
    return placed


def test_a_grpo_group_lands_on_the_engine_holding_its_prefix(fleet):
    assert fleet.flush_cache()
    first = _group_round(fleet, [GROUP_A, GROUP_B], seed=1)
    engine_a, engine_b = ({e for e, _ in first[len(g)]} for g in (GROUP_A, GROUP_B))
    # each group whole on one engine; A took engine 0, so the load put B on the other
    assert engine_a == {0} and engine_b == {1}
    # the other order: by load alone B would now go to engine 0; by prefix it goes home
    second = _group_round(fleet, [GROUP_B, GROUP_A], seed=2)
    for group, engine in ((GROUP_A, 0), (GROUP_B, 1)):
        assert {e for e, _ in second[len(group)]} == {engine}
        assert min(c for _, c in second[len(group)]) >= len(group) - 1   # every sample hits
    assert fleet.loads[0].requests == fleet.loads[1].requests == 0   # nothing left counted


def test_distinct_prompts_spread_and_are_answered_once(fleet):
    prompts = [[1 + i, 7 * i % 50 + 2, 3, 40 + i] for i in range(8)]
    outs = fleet.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2,
                                                              "temperature": 0.0},
                          rid=[f"r{i}" for i in range(8)])
    assert [o["meta_info"]["id"] for o in outs] == [f"r{i}" for i in range(8)]
    assert Counter(o["meta_info"]["engine_index"] for o in outs) == {0: 4, 1: 4}
    single = fleet.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2,
                                                                   "temperature": 0.0})
    assert single["output_ids"] == outs[0]["output_ids"]
    from_asyncio = asyncio.run(fleet.async_generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 2, "temperature": 0.0}))
    assert [o["output_ids"] for o in from_asyncio] == [o["output_ids"] for o in outs]
    assert fleet.loads[0].requests == fleet.loads[1].requests == 0


def test_one_broadcast_refits_both_engines_like_fresh_ones(fleet, fresh_w1, w2):
    report = fleet.refit(w2.model, version="ray-w2")
    assert report.ok and report.versions == {0: "ray-w2", 1: "ray-w2"}
    assert report.transport == "distributed"
    assert fleet.fleet.syncer.transport.world_size == 3     # trainer + one rank per engine
    payload = nbytes(state_dict_items(w2.model))
    assert payload <= report.bytes <= payload + 15 * len(list(state_dict_items(w2.model)))
    for r in report.engines:   # each engine's own refit seconds, within the refit's
        assert 0 < r.seconds <= report.seconds
    for e in fleet.engines:
        assert e.get_weights_by_name(PROBE, 4) == w2.probe
        rows = rollouts(e)
        assert_same_rollouts(rows, w2.expected)
        assert {v for _, _, v in rows} == {"ray-w2"}
    assert fleet.get_weight_version() == "ray-w2"


def test_tensor_handles_cross_ray_to_every_engine(fleet, w1_w2, fresh_w1):
    """The same actors refitted by shared-memory handles (only handles cross Ray)."""
    with RolloutFleet(fleet.engines, transport="tensor", bucket_bytes=BUCKET,
                      timeout_s=TIMEOUT_S) as by_handles:
        assert by_handles.refit(_load_hf(w1_w2[0]), version="ray-w1").ok
    for e in fleet.engines:
        assert_same_rollouts(rollouts(e), fresh_w1)


def test_sleep_wake_pause_fan_out(fleet, fresh_w1, w2):
    from rollout_engine.tokenizer_manager import EngineAsleepError

    assert fleet.pause("retract").ok
    report = fleet.sleep()
    assert [r.index for r in report.engines] == [0, 1]
    assert all(r.answer["bytes_freed"] > 0 for r in report.engines)
    with pytest.raises(EngineAsleepError):
        fleet.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert fleet.loads[0].requests == fleet.loads[1].requests == 0
    assert fleet.wake().ok           # weights are zeros now: stale until the refit
    assert fleet.continue_generation().ok
    fleet.refit(w2.model, version="after-sleep")
    for e in fleet.engines:
        assert_same_rollouts(rollouts(e), w2.expected)
    assert len(fleet.check_integrity()) == 2


def test_bad_arguments_name_the_field(fleet, w1_w2):
    for kwargs, field in ((dict(num_engines=0), "num_engines"),
                          (dict(base_gpu_id=0), "base_gpu_id"),
                          (dict(placement_strategy="ANYWHERE"), "placement_strategy"),
                          (dict(load_balance_method="random"), "load_balance_method"),
                          (dict(transport="carrier-pigeon"), "transport")):
        with pytest.raises(ValueError, match=field):
            RayFleetConfig(**kwargs)
    with pytest.raises(ValueError, match="dtype"):   # before any actor starts
        RayRolloutFleet({"model_path": w1_w2[0], "dtype": "float33"})
    with pytest.raises(ValueError, match="prompt / input_ids"):
        fleet.generate(sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="sampling_params: 1 values for 2 prompts"):
        fleet.generate(input_ids=[[1, 2], [3, 4]], sampling_params=[{"max_new_tokens": 1}])
    with pytest.raises(ValueError, match="stream"):
        fleet.generate(input_ids=[1, 2], stream=True)


def test_gpu_placement_flags():
    """Bundles and each engine's device (no GPU needed: what the actors would be given)."""
    config = RayFleetConfig(num_engines=4, num_gpus_per_engine=0.5, base_gpu_id=2)
    assert config.bundle() == {"CPU": 1.0, "GPU": 0.5}
    assert [config.engine_kwargs(i, {"model_path": "m"})["base_gpu_id"] for i in range(4)] == [
        2, 2, 3, 3]   # two engines share each GPU
    assert config.engine_kwargs(0, {})["device"] == "cuda"
    by_ray = RayFleetConfig(num_gpus_per_engine=1).engine_kwargs(1, {"num_threads": 4})
    assert "base_gpu_id" not in by_ray and by_ray["num_threads"] == 4
    assert RayFleetConfig(num_cpus_per_engine=2).engine_kwargs(0, {}) == {"device": "cpu",
                                                                          "num_threads": 2}


def test_a_group_the_cluster_cannot_hold_is_a_clear_error(fleet, w1_w2):
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="placement group not ready within 1 s"):
        RayRolloutFleet({"model_path": w1_w2[0]},
                        RayFleetConfig(num_engines=2, num_cpus_per_engine=4, start_timeout_s=1))
    assert time.perf_counter() - start < 10


def test_ray_is_on_loopback_or_not_started():
    """Ray's addresses are 127.0.0.1 (this test session's); a Ray imported without
    LOCAL_ONLY_ENV would take the host's interface address, so start_local_ray refuses it before
    starting anything."""
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    env = {k: v for k, v in os.environ.items() if k != LOCAL_ONLY_ENV}
    code = ("import ray\nfrom trainer_bridge.ray import start_local_ray\ntry:\n"
            "    start_local_ray(1)\nexcept RuntimeError as e:\n"
            "    print(ray.is_initialized(), e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.startswith(f"False Ray would start on this host's interface address: "
                                  f"set {LOCAL_ONLY_ENV}=0 before importing ray"), done.stderr


def test_an_engine_killed_mid_refit_is_reported_and_none_serves_mixed(fleet, fresh_w1, w2,
                                                                       monkeypatch):
    from rollout_engine.tokenizer_manager import EngineAsleepError

    victim = fleet.engines[1]
    submit, calls = victim._submit, []   # what submit and send_call both go through

    def killed_on_third_bucket(method: str, args: Any, kwargs: Any) -> Any:
        if method == "update_weights_from_distributed":
            calls.append(method)
            if len(calls) == 3:   # two buckets of step-2 applied, the rest in flight
                ray.kill(victim.actor, no_restart=True)
        return submit(method, args, kwargs)
    monkeypatch.setattr(victim, "_submit", killed_on_third_bucket)

    start = time.perf_counter()
    with pytest.raises(FleetRefitError) as caught:
        fleet.refit(w2.model, version="step-2")
    assert len(calls) >= 3
    assert time.perf_counter() - start < 3 * TIMEOUT_S
    survivor, dead = caught.value.report.engines
    assert dead.index == 1 and not dead.ok and dead.version is None
    assert "engine 1: unreachable" in str(caught.value)
    assert "its Ray actor died" in str(caught.value)
    # the survivor holds some buckets of step-2: never served, quarantined instead
    assert survivor.version.startswith("step-2.partial") and survivor.quarantined
    assert fleet.last_refit is caught.value.report
    with pytest.raises(EngineAsleepError):
        fleet.engines[0].generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    with pytest.raises(RuntimeError, match="no engine is serving"):
        fleet.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})

    # the next refit wakes the survivor and refits it over a group without the dead engine
    again = fleet.refit(w2.model, version="step-3")
    assert again.versions == {0: "step-3"}
    outs = fleet.generate(input_ids=[GROUP_A, GROUP_B], sampling_params={"max_new_tokens": 1})
    assert {o["meta_info"]["engine_index"] for o in outs} == {0}
    assert_same_rollouts(rollouts(fleet.engines[0]), w2.expected)
    assert len(fleet.check_integrity()) == 1
