"""--tp-size 2 beyond parity, on a model with one KV head (a copy on each rank), paged KV and
chunked prefill: equal to one rank; an update one rank refuses changes no rank; ranks left on
different whole weights (norms) fail check_integrity; weight reads return whole weights; a
retracted request resumes as it would have run; sizes that cannot shard are refused up front;
a stuck rank (slow test) or a killed one fails the request in flight with an error naming it
(the kill runs last: it ends the module's engine)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints.launch_server import parse_args
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.weights.loader import iter_safetensors
from tests.rollout_engine.engines import colocated_refits, thread_engine

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPTS = [[1, 2, 3], [9, 30, 200, 11, 300, 17], list(range(40, 60))]
# pages of 4 slots and 8-token prefill chunks: the last prompt is prefilled in three chunks
FLAGS = {"max_total_tokens": 1024, "page_size": 4, "chunked_prefill_size": 8}


@pytest.fixture(scope="module")
def one_kv_head() -> str:
    """4 query heads, 1 KV head: each of 2 ranks keeps a copy of the KV head."""
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2", num_kv_heads=1))


def _rollouts(engine: Any, max_new_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, return_logprob=True,
                           sampling_params={**GREEDY, "max_new_tokens": max_new_tokens})
    return [(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _same(rows: list[Any], want: list[Any]) -> None:
    assert [ids for ids, _ in rows] == [ids for ids, _ in want]
    assert max(abs(a - b) for (_, x), (_, y) in zip(rows, want) for a, b in zip(x, y)) <= 1e-4


@pytest.fixture(scope="module")
def one_rank(one_kv_head: str) -> list[Any]:
    for eng in thread_engine(one_kv_head, **FLAGS):
        return _rollouts(eng)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def tp2(one_kv_head: str) -> Iterator[Any]:
    from rollout_engine import Engine

    eng = Engine(model_path=one_kv_head, tp_size=2, dtype="float32", device="cpu", **FLAGS)
    try:
        yield eng
    finally:
        eng.shutdown()


def test_paged_chunked_prefill_matches_one_rank(tp2, one_rank):
    _same(_rollouts(tp2), one_rank)


def test_an_update_one_rank_refuses_changes_no_rank(tp2, one_rank, one_kv_head):
    good = list(iter_safetensors(one_kv_head))
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in good]
    ok, message = tp2.update_weights_from_tensor(
        [serialize_named_tensors(good), serialize_named_tensors(bad)])   # one per rank
    assert not ok
    assert "tensor-parallel rank 1" in message and "model.norm.weight" in message
    ok, message = tp2.update_weights_from_tensor([serialize_named_tensors(good)] * 3)
    assert not ok and "one payload per tensor-parallel rank (2) or one for all, got 3" in message
    _same(_rollouts(tp2), one_rank)   # neither rank wrote anything
    assert tp2.check_integrity()["tp_ranks"][0]["tp_rank"] == 1


def test_ranks_holding_different_whole_weights_fail_check_integrity(tp2, one_rank,
                                                                    one_kv_head):
    good = list(iter_safetensors(one_kv_head))
    other = [(n, t + 1 if n == "model.norm.weight" else t) for n, t in good]
    ok, message = tp2.update_weights_from_tensor(
        [serialize_named_tensors(good), serialize_named_tensors(other)])
    assert ok, message   # each rank's payload is valid on its own
    with pytest.raises(AssertionError, match="tensor-parallel rank 1 holds other values than "
                                             "rank 0 in the weights every rank keeps whole"):
        tp2.check_integrity()
    assert tp2.update_weights_from_tensor(good)[0]   # one payload: every rank the same
    assert tp2.check_integrity()["tp_ranks"][0]["replicated_checksum"] is not None
    _same(_rollouts(tp2), one_rank)


def test_weight_reads_join_every_ranks_slice(tp2, one_kv_head):
    full = dict(iter_safetensors(one_kv_head))
    for name, rows in (("model.layers.0.self_attn.o_proj.weight", 3),   # columns split
                       ("model.layers.1.mlp.gate_proj.weight", 100),    # rows: 64 a rank
                       ("model.layers.0.self_attn.k_proj.weight", 100),  # replicated
                       ("model.embed_tokens.weight", 2)):
        got = torch.tensor(tp2.get_weights_by_name(name, truncate_size=rows))
        assert torch.equal(got, full[name][:rows].float()), name


def test_weights_checker_checks_every_ranks_slices(tp2, one_rank, one_kv_head):
    """SGLang's /weights_checker under tp 2: each rank snapshots, resets, compares and hashes
    its own slices; a rank whose slice differs fails the compare, naming it."""
    def check(action: str, **kw: Any) -> Any:
        return tp2.tm.call("weights_checker", action=action, **kw)

    good = list(iter_safetensors(one_kv_head))
    ranks = check("checksum").result["ranks"]
    assert [r["parallelism_info"][0]["tp_rank"] for r in ranks] == [0, 1]
    name = "model.layers.1.mlp.gate_proj.weight"            # rows split: 64 a rank
    assert ranks[0]["checksums"][name] != ranks[1]["checksums"][name]
    assert check("snapshot").success and check("reset_tensors").success
    assert tp2.get_server_info()["weights_stale"] is True
    assert tp2.update_weights_from_tensor(good)[0]
    assert check("compare").success
    assert check("checksum").result["ranks"] == ranks
    # rank 1's rows of one weight differ from the snapshot
    other = [(n, torch.cat([t[:64], t[64:] + 1]) if n == name else t) for n, t in good]
    assert tp2.update_weights_from_tensor(other)[0]
    r = check("compare")
    assert not r.success and r.status == 400
    assert r.message.startswith("tensor-parallel rank 1: ") and f"name={name} " in r.message
    assert tp2.update_weights_from_tensor(good)[0]
    assert check("compare").success
    _same(_rollouts(tp2), one_rank)


def test_a_retracted_request_resumes_as_it_would_have_run(tp2, one_rank):
    stream = tp2.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, stream=True)
    next(stream)
    assert tp2.pause_generation(mode="retract")["mode"] == "retract"
    tp2.continue_generation()
    *_, last = stream
    assert last["output_ids"] == one_rank[2][0]


def test_tensor_refits_keep_the_trainers_shm_through_sleep_and_wake(tp2, one_rank, one_kv_head):
    """The colocated loop on TP=2 (refit by tensor handles, sleep, wake, refit): one payload
    is every rank's, so only one rank may drop the sender's shm references; both dropping
    them unlinked the trainer's files at the first sleep and the refit after the wake failed
    ("does not exist"). The files live while the trainer does, and not after."""
    import gc

    from transformers import AutoModelForCausalLM


    trainer = AutoModelForCausalLM.from_pretrained(one_kv_head, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.data = p.data.clone()   # memory of its own, as a trainer's weights are
    path = colocated_refits(tp2, trainer)
    _same(_rollouts(tp2), one_rank)
    assert os.path.exists(path)
    tp2.release_memory_occupation(["weights"])   # both ranks unmap it
    tp2.resume_memory_occupation(["weights"])
    assert tp2.update_weights_from_disk(one_kv_head)[0]
    del trainer, p
    gc.collect()
    assert not os.path.exists(path)


def test_sizes_that_cannot_shard_are_refused(one_kv_head):
    with pytest.raises(ValueError, match=r"tp_size: must divide num_attention_heads \(4\)"):
        EngineConfig(model_path=one_kv_head, tp_size=3)
    with pytest.raises(ValueError, match="scheduler_mode: tp_size > 1 runs every rank"):
        EngineConfig(model_path=one_kv_head, tp_size=2, scheduler_mode="thread")
    with pytest.raises(ValueError, match="enable_hierarchical_cache: is not supported with"):
        EngineConfig(model_path=one_kv_head, tp_size=2, enable_hierarchical_cache=True)
    assert EngineConfig.from_kwargs(model_path=one_kv_head, tp_size=2).tp_size == 2
    assert parse_args(["--model-path", "/m", "--tensor-parallel-size", "2",
                       "--dist-timeout", "60"]) == {
        "model_path": "/m", "tp_size": 2, "dist_timeout": 60}


def test_a_killed_rank_fails_the_request_in_flight_at_once(tp2):
    """Runs last in this module: it takes the module's engine down."""
    from rollout_engine.request_state import SchedulerDeadError

    pids = tp2.tm.server_info["tp_pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    stream = tp2.generate(input_ids=[1, 2, 3], stream=True,
                          sampling_params={**GREEDY, "max_new_tokens": 1000, "ignore_eos": True})
    next(stream)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(SchedulerDeadError, match=r"tensor-parallel rank 1 \(pid \d+\) is gone"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    with pytest.raises(SchedulerDeadError, match="tensor-parallel rank 1"):
        tp2.generate(input_ids=[1, 2], sampling_params=GREEDY)


@pytest.mark.slow
def test_a_stuck_rank_fails_the_request_after_dist_timeout(one_kv_head):
    """A rank that stops answering (SIGSTOP) is not waited for beyond ``dist_timeout``."""
    from rollout_engine import Engine
    from rollout_engine.request_state import SchedulerDeadError

    eng = Engine(model_path=one_kv_head, tp_size=2, dtype="float32", device="cpu",
                 dist_timeout=3, **FLAGS)
    rank1 = eng.tm.server_info["tp_pids"][1]
    try:
        os.kill(rank1, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(SchedulerDeadError, match=r"took longer than 3 s \(dist_timeout\)"):
            eng.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        assert time.monotonic() - start < 3 + 10
    finally:
        os.kill(rank1, signal.SIGKILL)
        eng.shutdown()
