"""Adapters from tensors (pairs, a dict, our flattened bucket, SGLang's flattened bucket as slime
and miles send it) serve exactly as the same adapter read from its directory; a bad adapter or
payload is refused naming the problem and changes nothing; loads, unloads and the
``max_loaded_loras`` bound; a request naming an unknown adapter is refused while others run."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rollout_engine.protocol.bucket import pack_buckets
from rollout_engine.tokenizer_manager import EngineBusyError
from tests.rollout_engine.compat.sglang_fakes import file_system_sharing, slime_payloads
from tests.rollout_engine.lora.adapters import adapter_tensors, prompts

GREEDY = {"temperature": 0, "max_new_tokens": 8}
A = "base_model.model.model.layers.{}.{}.lora_A.weight"


@pytest.fixture
def engine(make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str]) -> Any:
    return make_engine(qwen2_path, lora_paths=[f"dir={adapters['all8']}"], max_loaded_loras=8,
                       max_lora_rank=16)


def _out(engine: Any, adapter: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    r = engine.generate(input_ids=prompt, lora_path=adapter, return_logprob=True,
                        sampling_params=GREEDY)
    return r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]


def _loaded(engine: Any) -> dict[str, Any]:
    return engine.get_server_info()["loaded_adapters"]


@pytest.fixture
def _file_system() -> Iterator[None]:
    with file_system_sharing():
        yield


def test_every_tensor_form_serves_as_the_directory(engine: Any, adapters: dict[str, str],
                                                   vocab: int, _file_system: None) -> None:
    config, named = adapter_tensors(adapters["all8"])
    engine.load_lora_adapter_from_tensors("pairs", named, config)
    engine.load_lora_adapter_from_tensors("dict", dict(named), config)
    bare = [(n.removeprefix("base_model.model."), t) for n, t in named]   # a trainer's names
    engine.load_lora_adapter_from_tensors("bare", bare, config)
    engine.load_lora_adapter_from_tensors("ours", list(pack_buckets(named, 1 << 30)), config,
                                          load_format="flattened_bucket")
    (payload,), _keep = slime_payloads(named)    # SGLang's bucket, pickled by SGLang's classes
    engine.load_lora_adapter_from_tensors("sglang", payload, config,
                                          load_format="flattened_bucket")
    prompt = prompts(vocab, [14], seed=2)[0]
    want = _out(engine, "dir", prompt)
    for name in ("pairs", "dict", "bare", "ours", "sglang"):
        assert _out(engine, name, prompt) == want, name
    assert _loaded(engine)["sglang"]["lora_path"] == "__tensor__"


def _bad_dir(tmp_path: Any, name: str, config: dict[str, Any],
             tensors: dict[str, torch.Tensor]) -> str:
    path = os.path.join(str(tmp_path), name)
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    if tensors:
        save_file({n: t.clone() for n, t in tensors.items()},
                  os.path.join(path, "adapter_model.safetensors"))
    return path


def _refusals(adapter_dir: str) -> list[tuple[str, dict[str, Any], list[tuple[str, Any]], str]]:
    """(what, config, tensors, the message's telling part) of adapters that must be refused."""
    config, named = adapter_tensors(adapter_dir)
    good = dict(named)
    a0 = good[A.format(0, "self_attn.q_proj")]
    return [
        ("unknown module", config, [*named, (A.format(0, "embed_tokens"), a0)],
         "not a LoRA weight of a supported module"),
        ("wrong shape", config, [(n, t[:, :-1] if n == A.format(0, "self_attn.q_proj") else t)
                                 for n, t in named], "expected [8, 64]"),
        ("rank too big", {**config, "r": 32},
         [(n, t.repeat(4, 1) if "lora_A" in n else t.repeat(1, 4)) for n, t in named],
         "above this engine's max_lora_rank (16)"),
        ("DoRA", {**config, "use_dora": True}, named, "use_dora: DoRA adapters are not"),
        ("bias", {**config, "bias": "all"}, named, "bias: adapters with trained biases"),
        ("half a pair", config, [(n, t) for n, t in named if n != A.format(1, "mlp.up_proj")],
         "layer 1 up_proj: lora_A.weight is missing"),
        ("layer out of range", config, [*named, (A.format(7, "self_attn.q_proj"), a0)],
         "the model has 2 layers"),
        ("experts", config, [*named, ("base_model.model.model.layers.0.mlp.experts.0."
                                      "gate_proj.lora_A.weight", a0)],
         "mixture-of-experts experts are not supported"),
        ("not finite", config, [(n, t.clone().fill_(float("nan")) if n == A.format(
            0, "self_attn.k_proj") else t) for n, t in named], "non-finite"),
        ("no tensors", config, [], "the adapter has no LoRA weights"),
        ("regex targets", {**config, "target_modules": ".*proj"}, named,
         "a regular expression"),
    ]


def test_bad_adapters_are_refused_and_change_nothing(engine: Any, adapters: dict[str, str],
                                                     tmp_path: Any, vocab: int) -> None:
    prompt = prompts(vocab, [9], seed=4)[0]
    before, loaded = _out(engine, "dir", prompt), _loaded(engine)
    for what, config, named, message in _refusals(adapters["all8"]):
        for name in ("fresh", "dir"):       # a new name, and an upsert of a loaded one
            with pytest.raises(ValueError, match=re.escape(message)):
                engine.load_lora_adapter_from_tensors(name, named, config, upsert=True)
        if named:
            path = _bad_dir(tmp_path, what.replace(" ", "-"), config, dict(named))
            with pytest.raises(ValueError, match=re.escape(message)):
                engine.load_lora_adapter("dir", path, upsert=True)
        assert _loaded(engine) == loaded, what
    after = _out(engine, "dir", prompt)        # its prompt's KV now from the cache
    assert after[0] == before[0] and after[1] == pytest.approx(before[1], abs=1e-5)
    # a directory without safetensors, with a pickled .bin: refused, not unpickled
    pickled = _bad_dir(tmp_path, "pickled", adapter_tensors(adapters["all8"])[0], {})
    open(os.path.join(pickled, "adapter_model.bin"), "wb").close()
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle, which is not read"):
        engine.load_lora_adapter("pickled", pickled)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.load_lora_adapter("nothing", str(tmp_path))
    assert _loaded(engine) == loaded


def test_load_unload_and_the_limit_on_loaded_adapters(
        make_engine: Callable[..., Any], qwen2_path: str, adapters: dict[str, str],
        vocab: int) -> None:
    engine = make_engine(qwen2_path, enable_lora=True, max_lora_rank=64,
                         lora_target_modules=["all"], max_loras_per_batch=2,
                         max_loaded_loras=2)
    # AReaL's versioned names are plain names
    assert engine.load_lora_adapter("a", adapters["all8"])["loaded_adapters"].keys() == {"a"}
    engine.load_lora_adapter("b-v1", adapters["qv64"])
    with pytest.raises(ValueError, match="max_loaded_loras is 2; unload one first"):
        engine.load_lora_adapter("c", adapters["linear4"])
    with pytest.raises(ValueError, match="already loaded; unload it first, or pass upsert"):
        engine.load_lora_adapter("a", adapters["linear4"])
    assert sorted(_loaded(engine)) == ["a", "b-v1"]
    assert engine.unload_lora_adapter("a")["loaded_adapters"].keys() == {"b-v1"}
    with pytest.raises(ValueError, match="no adapter named 'a' is loaded"):
        engine.unload_lora_adapter("a")
    with pytest.raises(ValueError, match="lora_path: no adapter named 'a' is loaded"):
        engine.generate(input_ids=[5, 6, 7], lora_path="a", sampling_params=GREEDY)
    engine.load_lora_adapter("b-v2", adapters["linear4"])
    assert sorted(_loaded(engine)) == ["b-v1", "b-v2"]
    out = engine.generate(input_ids=[[5, 6, 7], [5, 6, 7]], lora_path=["b-v1", "b-v2"],
                          sampling_params=GREEDY)
    assert all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in out)


def test_unknown_adapter_refused_while_others_run_and_unload_in_use_is_409(
        engine: Any, vocab: int) -> None:
    prompt = prompts(vocab, [10], seed=6)[0]
    stream = engine.generate(input_ids=prompt, lora_path="dir", stream=True, rid="busy",
                             sampling_params={**GREEDY, "max_new_tokens": 1500,
                                              "ignore_eos": True})
    next(stream)
    with pytest.raises(ValueError, match="lora_path: no adapter named 'nope' is loaded"):
        engine.generate(input_ids=[prompt, prompt], lora_path=[None, "nope"],
                        sampling_params=GREEDY)
    with pytest.raises(EngineBusyError, match="'dir' is in use by 1 request"):
        engine.unload_lora_adapter("dir")
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    box: dict[str, Any] = {}
    drain = threading.Thread(target=lambda: box.update(last=list(stream)[-1]))
    drain.start()
    engine.abort_request("busy")
    drain.join(30)
    assert box["last"]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.unload_lora_adapter("dir")


def test_lora_off_refuses_adapters(make_engine: Callable[..., Any], qwen2_path: str,
                                   adapters: dict[str, str]) -> None:
    engine = make_engine(qwen2_path)
    with pytest.raises(ValueError, match="serves no LoRA adapters; start it with --enable-lora"):
        engine.generate(input_ids=[5, 6], lora_path="a", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        engine.load_lora_adapter("a", adapters["all8"])
    assert engine.get_server_info()["loaded_adapters"] == {}
