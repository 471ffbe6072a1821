"""Control calls on a --dp-size 2 engine (child processes, as served): a refit by each
transport (disk, tensor handles, one broadcast to both replicas' ranks) and a sleep / wake
cycle leave both replicas answering exactly like a fresh engine on the new weights; a replica
that dies takes the engine down with an error naming it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import colocated_refits, thread_engine

GREEDY = {"max_new_tokens": 5, "temperature": 0.0}
PROMPTS = [[1, 2, 3], [9, 30, 200, 11], [5, 6], [70, 71, 72, 73, 74]]


@pytest.fixture(scope="module")
def w1_w2() -> tuple[str, str]:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))


def _rollouts(engine: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and logprobs; round robin sends the four prompts to both replicas."""
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _same(rows: list[Any], want: list[Any]) -> None:
    assert [ids for ids, _ in rows] == [ids for ids, _ in want]
    worst = max(abs(a - b) for (_, x), (_, y) in zip(rows, want) for a, b in zip(x, y))
    assert worst <= 1e-4


@pytest.fixture(scope="module")
def fresh(w1_w2: tuple[str, str]) -> dict[str, Any]:
    out = {}
    for name, path in zip(("w1", "w2"), w1_w2):
        for eng in thread_engine(path, max_total_tokens=512):
            out[name] = _rollouts(eng)
    assert out["w1"] != out["w2"]
    return out


@pytest.fixture(scope="module")
def dp2(w1_w2: tuple[str, str]) -> Iterator[Any]:
    from rollout_engine import Engine

    eng = Engine(model_path=w1_w2[0], dtype="float32", device="cpu", dp_size=2,
                 load_balance_method="round_robin", max_total_tokens=512)
    try:
        yield eng
    finally:
        eng.shutdown()


def _versions(engine: Any) -> list[str]:
    return [r["weight_version"] for r in engine.get_server_info()["dp_results"]]


def test_refit_by_every_transport_and_sleep_wake(dp2, fresh, w1_w2):
    from rollout_engine.tokenizer_manager import EngineAsleepError
    from trainer_bridge import WeightSyncer

    w1, w2 = w1_w2
    _same(_rollouts(dp2), fresh["w1"])
    assert dp2.update_weights_from_disk(w2, weight_version="disk")[0]
    _same(_rollouts(dp2), fresh["w2"])
    assert _versions(dp2) == ["disk", "disk"]

    ok, message = dp2.update_weights_from_tensor(list(iter_safetensors(w1)),
                                                 weight_version="tensor")
    assert ok, message
    _same(_rollouts(dp2), fresh["w1"])

    # one broadcast; the group has 1 + 2 ranks (a rank per replica)
    with WeightSyncer(dp2, transport="distributed", bucket_bytes=64 << 10) as syncer:
        assert syncer.transport.world_size == 3
        syncer.sync(list(iter_safetensors(w2)), version="broadcast")
    _same(_rollouts(dp2), fresh["w2"])
    assert _versions(dp2) == ["broadcast", "broadcast"]

    dp2.pause_generation("retract")
    freed = dp2.release_memory_occupation()
    assert freed["bytes_freed"] == sum(r["bytes_freed"] for r in freed["dp_results"]) > 0
    with pytest.raises(EngineAsleepError):
        dp2.generate(input_ids=[1, 2], sampling_params=GREEDY)
    dp2.resume_memory_occupation()
    dp2.continue_generation()
    with pytest.raises(EngineAsleepError, match="stale"):   # zeros until every weight lands
        dp2.generate(input_ids=[1, 2], sampling_params=GREEDY)
    assert dp2.update_weights_from_disk(w1, weight_version="woken")[0]
    _same(_rollouts(dp2), fresh["w1"])
    assert dp2.flush_cache() is True
    integrity = dp2.check_integrity()
    assert len(integrity["dp_results"]) == 2 and all(r["idle"] for r in integrity["dp_results"])


def test_tensor_refits_keep_the_trainers_shm_through_sleep_and_wake(dp2, fresh, w1_w2):
    """The colocated loop on two replicas (refit by tensor handles, sleep, wake, refit): both
    read the same payload, so only one may drop the sender's shm references; both dropping
    them unlinked the trainer's files at the first sleep and the refit after the wake failed
    ("does not exist"). The files live while the trainer does, and not after."""
    import gc

    weights = [(n, t.clone()) for n, t in iter_safetensors(w1_w2[1])]   # the trainer's own
    path = colocated_refits(dp2, weights)
    _same(_rollouts(dp2), fresh["w2"])
    assert os.path.exists(path)
    dp2.release_memory_occupation(["weights"])   # both replicas unmap it
    dp2.resume_memory_occupation(["weights"])
    assert dp2.update_weights_from_disk(w1_w2[0])[0]
    weights.clear()
    gc.collect()
    assert not os.path.exists(path)


def test_a_dead_replica_takes_the_engine_down(dp2):
    from rollout_engine.request_state import SchedulerDeadError

    pids = dp2.tm.server_info["dp_pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(SchedulerDeadError, match="dp rank 1"):
        for _ in range(100):   # the death is noticed within the reader's poll
            dp2.tm.host.dp_chan.replicas[1].proc.wait(10)
            dp2.generate(input_ids=[1, 2], sampling_params=GREEDY)
