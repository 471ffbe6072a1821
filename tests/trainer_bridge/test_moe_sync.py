"""WeightSyncer from a transformers Qwen3-MoE (transformers 5 names its experts as one stacked
tensor per layer) into an engine on other weights, over the packed (flattened-bucket) and plain
transports: the engine then answers like a fresh engine on the trainer's weights."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.testing.tiny_moe import tiny_moe_path
from tests.trainer_bridge.conftest import assert_same_rollouts, rollouts
from trainer_bridge import WeightSyncer
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport

BUCKET = 64 << 10


@pytest.fixture(scope="module")
def setup():
    """(w1 path, the trainer on w2, a fresh engine's w2 rollouts, a process-mode engine)."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    w1, w2 = str(tiny_moe_path("qwen3_moe")), str(tiny_moe_path("qwen3_moe", seed=1))
    trainer = AutoModelForCausalLM.from_pretrained(w2, dtype=torch.float32).eval()
    with Engine(model_path=w2, scheduler_mode="thread", device="cpu", dtype="float32") as ref:
        want = rollouts(ref)
    engine = Engine(model_path=w1, device="cpu", dtype="float32")
    try:
        yield w1, trainer, want, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transport", ["tensor", "tensor-packed", "distributed-packed", "disk"])
def test_sync_from_a_transformers_moe(setup, transport) -> None:
    w1, trainer, want, engine = setup
    assert engine.update_weights_from_disk(w1)[0]
    assert [r[0] for r in rollouts(engine)] != [r[0] for r in want]
    chosen = {"tensor-packed": lambda: TensorTransport(BUCKET, pack=True),
              "distributed-packed": lambda: DistributedTransport(bucket_bytes=BUCKET, pack=True)
              }.get(transport, lambda: transport)()
    with WeightSyncer(engine, transport=chosen, bucket_bytes=BUCKET) as syncer:
        syncer.sync(trainer, version="step-1")
    rows = rollouts(engine)
    assert_same_rollouts(rows, want)
    assert {v for _, _, v in rows} == {"step-1"}


def test_client_asks_for_routed_experts(make_engine) -> None:
    """``RolloutClient.generate(return_routed_experts=True)`` against a MoE server started with
    the flag: every fed token's row comes back and decodes; without asking, no key."""
    from fastapi.testclient import TestClient

    from rollout_engine.entrypoints.http_server import create_app
    from trainer_bridge import RolloutClient
    from trainer_bridge.routing_replay import decode_routed_experts

    engine = make_engine(str(tiny_moe_path("qwen3_moe")), enable_return_routed_experts=True)
    client = RolloutClient("http://testserver")
    client.http = TestClient(create_app(engine))   # the client's requests, in process
    prompt = [5, 6, 7, 8, 9]
    out = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4,
                                                             "temperature": 0.0},
                          return_routed_experts=True, routed_experts_start_len=2)
    rows = decode_routed_experts(out["meta_info"]["routed_experts"], num_layers=2, top_k=2)
    assert rows.shape == (len(prompt) + len(out["output_ids"]) - 1 - 2, 2, 2)
    plain = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4})
    assert "routed_experts" not in plain["meta_info"]
