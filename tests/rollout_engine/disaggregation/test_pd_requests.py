"""The bootstrap fields as a generate call carries them, and the flags a role refuses."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_engine import EngineConfig
from rollout_engine.protocol.messages import GenerateReq
from rollout_engine.request_builder import RequestBuilder, RequestLimits

BOOT = {"host": "10.0.0.7", "port": 8998, "room": 1234}


def _build(**kw: Any) -> list[GenerateReq]:
    builder = RequestBuilder(tokenizer=None, vocab_size=64, context_len=1000,
                             rng=random.Random(0), limits=RequestLimits(20, 64, 256, 1024))
    return builder.build(**kw)[0]


def test_samples_take_one_room_each_and_a_seed_both_servers_derive() -> None:
    reqs = _build(input_ids=[1, 2, 3], sampling_params={"n": 3}, bootstrap=BOOT)
    assert [r.bootstrap.room for r in reqs] == ["1234-0", "1234-1", "1234-2"]
    assert {(r.bootstrap.host, r.bootstrap.port) for r in reqs} == {("10.0.0.7", 8998)}
    again = _build(input_ids=[1, 2, 3], sampling_params={"n": 3}, bootstrap=BOOT)
    assert [r.seed for r in reqs] == [r.seed for r in again]     # the room decides the seed
    other = _build(input_ids=[1, 2, 3], sampling_params={"n": 3},
                   bootstrap={**BOOT, "room": 99})
    assert [r.seed for r in reqs] != [r.seed for r in other]
    seeded = _build(input_ids=[1, 2, 3], sampling_params={"sampling_seed": 5}, bootstrap=BOOT)
    assert seeded[0].seed == 5 and seeded[0].bootstrap.room == "1234"


def test_a_batch_takes_a_room_per_prompt() -> None:
    reqs = _build(input_ids=[[1, 2], [3, 4]], bootstrap={
        "host": ["h", "h"], "port": [1, 1], "room": [7, 8]})
    assert [r.bootstrap.room for r in reqs] == ["7", "8"]
    assert _build(input_ids=[[1, 2], [3, 4]])[0].bootstrap is None


@pytest.mark.parametrize("fields, named", [
    ({"host": "h", "room": 5}, "give all three"),
    ({**BOOT, "room": True}, "bootstrap_room: must be an integer or a string"),
    ({**BOOT, "port": 70000}, "bootstrap_port: must be a TCP port"),
    ({**BOOT, "room": [1, 2, 3]}, "bootstrap_room: list has 3 entries"),
])
def test_bad_bootstrap_fields_are_value_errors_naming_them(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _build(input_ids=[1, 2, 3], bootstrap=fields)


@pytest.mark.parametrize("kw, named", [
    ({"disaggregation_mode": "both"}, "disaggregation_mode: must be one of"),
    ({"disaggregation_mode": "decode", "tp_size": 2}, "tp_size: is not combined"),
    ({"disaggregation_mode": "prefill", "enable_lora": True, "max_lora_rank": 8,
      "lora_target_modules": ["q_proj"]}, "enable_lora: is not combined"),
    ({"disaggregation_transfer_backend": "nccl"}, "disaggregation_transfer_backend: must be"),
    ({"disaggregation_transfer_timeout": 0}, "disaggregation_transfer_timeout: must be > 0"),
])
def test_flags_a_role_cannot_take_are_refused_by_name(qwen2_path: str, kw: dict,
                                                      named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(model_path=qwen2_path, **kw)
