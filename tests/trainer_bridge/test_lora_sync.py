"""LoraSyncer: a trainer's PEFT adapter, and only it, synced into engines every step.

After a sync an engine serves the adapter exactly as a fresh engine loaded from the adapter's
saved directory (greedy tokens; logprobs within 1e-5: the engine under test is a child
process, the reference a thread-mode engine); every sync moves the adapter's version and the
first request after it reuses no KV of the old version; a bad adapter is refused (before
anything is sent when the trainer can tell, else by the engine) and changes nothing. Through
the tensor handles (unpacked and packed) and the disk transport, on an Engine and over HTTP.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.trainer_bridge.live_server import live_client
from trainer_bridge import LoraSyncer, RolloutClient
from trainer_bridge.lora_source import adapter_source, config_dict
from trainer_bridge.transports.base import WeightSyncError

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, MAX_RANK = 8, 16, 16
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
TOL = 1e-5
TRANSPORTS = {"tensor": {"transport": "tensor", "pack": False},
              "tensor-packed": {"transport": "tensor", "pack": True},
              "disk": {"transport": "disk"}}
A_Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (19, 11)]


PROMPTS = _prompts()


def set_adapter(model: Any, seed: int) -> None:
    """The adapter's values of ``seed`` (B too: peft starts it at zero), written in place as
    an optimizer step writes them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def outputs(engine: Any, name: str) -> list[tuple[list[int], list[float], int]]:
    """(greedy ids, their logprobs, cached tokens) of each prompt with adapter ``name``."""
    out = []
    for ids in PROMPTS:
        o = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                            lora_path=name)
        meta = o["meta_info"]
        out.append((o["output_ids"], [lp for lp, *_ in meta["output_token_logprobs"]],
                    meta["cached_tokens"]))
    return out


def assert_same(got: list[Any], want: list[Any]) -> None:
    for (ids, lps, _), (want_ids, want_lps, _) in zip(got, want):
        assert ids == want_ids, f"tokens differ: {ids} vs {want_ids}"
        worst = max(abs(a - b) for a, b in zip(lps, want_lps))
        assert worst <= TOL, f"logprobs differ by {worst:.2e}"


def version_of(engine: Any, name: str) -> int:
    return engine.get_server_info()["loaded_adapters"][name]["version"]


@pytest.fixture(scope="module")
def trainer(qwen2_path: str) -> Any:
    """The trainer's model: the tiny qwen2 wrapped by peft (every projection, rank 8)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES,
                                           lora_dropout=0.0))


@pytest.fixture(scope="module")
def references(qwen2_path: str, trainer: Any, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[int, list[Any]]:
    """Seed -> the outputs of a fresh engine started with the adapter's saved directory."""
    from rollout_engine import Engine

    out = {}
    for seed in (1, 2):
        set_adapter(trainer, seed)
        path = str(tmp_path_factory.mktemp(f"adapter-{seed}"))
        trainer.save_pretrained(path)
        with Engine(model_path=qwen2_path, dtype="float32", device="cpu",
                    scheduler_mode="thread", lora_paths=[f"ref={path}"]) as fresh:
            out[seed] = outputs(fresh, "ref")
    assert out[1][0][0] != out[2][0][0]   # the two adapters answer differently
    return out


@pytest.fixture(scope="module")
def lora_engine(qwen2_path: str) -> Iterator[Any]:
    """A process-mode engine serving adapters up to rank 16 on every projection."""
    from rollout_engine import Engine

    eng = Engine(model_path=qwen2_path, dtype="float32", device="cpu", enable_lora=True,
                 max_lora_rank=MAX_RANK, lora_target_modules=["all"])
    try:
        yield eng
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def client(lora_engine: Any) -> Iterator[RolloutClient]:
    """A live server (uvicorn in a thread) over ``lora_engine``, and a client of it."""
    with live_client(lora_engine) as (c, _):
        yield c


def _sync_twice(engine: Any, syncer: LoraSyncer, trainer: Any,
                references: dict[int, list[Any]]) -> None:
    name = syncer.lora_name
    set_adapter(trainer, 1)
    first = syncer.sync(trainer)
    assert first.versions == (version_of(engine, name),)
    assert first.rank == RANK and first.num_engines == 1 and first.seconds > 0
    lora_bytes = sum(p.numel() * 4 for n, p in trainer.named_parameters() if "lora_" in n)
    if syncer.transport.name == "tensor" and syncer.transport.pack:
        assert lora_bytes <= first.bytes < lora_bytes + 64 * 4 * 2 * len(MODULES)
    else:
        assert first.bytes == lora_bytes
    v1 = outputs(engine, name)
    assert_same(v1, references[1])
    assert outputs(engine, name)[0][2] > 0            # the same version: its KV is reused
    set_adapter(trainer, 2)                           # the trainer's step, in place
    second = syncer.sync(trainer)
    assert second.versions[0] > first.versions[0]
    assert version_of(engine, name) == second.versions[0]
    v2 = outputs(engine, name)
    assert [cached for *_, cached in v2] == [0, 0]    # nothing of the old version reused
    assert_same(v2, references[2])


@pytest.mark.parametrize("how", list(TRANSPORTS))
def test_sync_serves_the_saved_adapter(lora_engine: Any, trainer: Any,
                                       references: dict[int, list[Any]], how: str) -> None:
    with LoraSyncer(lora_engine, f"policy-{how}", **TRANSPORTS[how]) as syncer:
        _sync_twice(lora_engine, syncer, trainer, references)
        syncer.unload()
    assert f"policy-{how}" not in lora_engine.get_server_info()["loaded_adapters"]


@pytest.mark.parametrize("how", ["tensor", "disk"])
def test_sync_over_http(client: RolloutClient, trainer: Any,
                        references: dict[int, list[Any]], how: str) -> None:
    with LoraSyncer(client, f"http-{how}", **TRANSPORTS[how]) as syncer:
        _sync_twice(client, syncer, trainer, references)
        _refusals_change_nothing(client, syncer, trainer)
        syncer.unload()


def _bad_adapters(trainer: Any) -> list[tuple[str, Any, dict[str, Any], type, str]]:
    """(what, tensors, config, the error, its telling part) of adapters that must be refused."""
    source = adapter_source(trainer)
    named, config = source.tensors, source.config
    wide = [(n, t.repeat(4, 1) if ".lora_A." in n else t.repeat(1, 4)) for n, t in named]
    return [
        ("rank not the config's", named, {**config, "r": 4}, ValueError,
         "is not of rank r=4"),
        ("a shape the model lacks", [(n, t[:, :-1] if n == A_Q0 else t) for n, t in named],
         config, WeightSyncError, "expected [8, 64]"),
        ("rank above the engine's", wide, {**config, "r": 32}, WeightSyncError,
         f"above this engine's max_lora_rank ({MAX_RANK})"),
        ("not a LoRA weight", [*named, ("base_model.model.model.norm.weight",
                                        torch.ones(64))], config, ValueError,
         "is not a LoRA weight"),
    ]


def _refusals_change_nothing(engine: Any, syncer: LoraSyncer, trainer: Any) -> None:
    name = syncer.lora_name
    before, version = outputs(engine, name), version_of(engine, name)
    for what, named, config, error, message in _bad_adapters(trainer):
        with pytest.raises(error, match=re.escape(message)):
            syncer.sync(named, config)
        assert version_of(engine, name) == version, what
    after = outputs(engine, name)
    assert_same(after, before)
    assert [cached for *_, cached in after] == [len(p) - 1 for p in PROMPTS]


@pytest.mark.parametrize("how", ["tensor", "disk"])
def test_bad_adapters_are_refused_and_change_nothing(lora_engine: Any, trainer: Any,
                                                     how: str) -> None:
    set_adapter(trainer, 3)
    with LoraSyncer(lora_engine, f"checked-{how}", **TRANSPORTS[how]) as syncer:
        syncer.sync(trainer)
        _refusals_change_nothing(lora_engine, syncer, trainer)
        syncer.unload()


def test_parameter_names_and_configs_become_peft_files(trainer: Any) -> None:
    """A PeftModel's adapter is what PEFT saves (get_peft_model_state_dict: the same names,
    the same tensors); named_parameters() names lose their adapter segment; a LoraConfig
    becomes plain JSON (its target_modules set a sorted list)."""
    from peft import get_peft_model_state_dict

    from_model = adapter_source(trainer)
    saved = get_peft_model_state_dict(trainer)
    assert sorted(n for n, _ in from_model.tensors) == sorted(saved)
    assert all(torch.equal(t, saved[n]) for n, t in from_model.tensors)
    pairs = [(n, p) for n, p in trainer.named_parameters() if "lora_" in n]
    assert ".lora_A.default.weight" in pairs[0][0]
    from_pairs = adapter_source(pairs, trainer.peft_config["default"])
    assert sorted(n for n, _ in from_pairs.tensors) == sorted(n for n, _ in from_model.tensors)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n, _ in from_pairs.tensors)
    assert from_pairs.config == from_model.config
    assert from_model.config["target_modules"] == sorted(MODULES)
    assert config_dict({"r": 8, "target_modules": {"v_proj", "q_proj"}})["target_modules"] == [
        "q_proj", "v_proj"]
    with pytest.raises(ValueError, match="not a PeftModel"):
        adapter_source(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="config: give the adapter's LoraConfig"):
        adapter_source(pairs)
    with pytest.raises(ValueError, match="no adapter 'other'"):
        adapter_source(trainer, adapter_name="other")


def test_no_broadcast_transport_for_adapters(lora_engine: Any) -> None:
    with pytest.raises(ValueError, match="no route that receives an adapter by broadcast"):
        LoraSyncer(lora_engine, "x", transport="distributed")
    with pytest.raises(ValueError, match="lora_name: must be a non-empty string"):
        LoraSyncer(lora_engine, "")
