"""--sampling-defaults model (SGLang's default): what a chat request omits of temperature,
top_p, top_k, min_p and repetition_penalty comes from the model's generation_config.json; an
explicit value wins, even OpenAI's default. As in SGLang, /generate, /v1/completions and the
Python Engine keep SamplingParams' defaults (slime's rollouts send what they sample with and
rely on that). --sampling-defaults openai restores the plain defaults on chat too."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_engine.config import EngineConfig
from rollout_engine.config.generation_defaults import read_sampling_defaults
from rollout_engine.sampling_params import SamplingParams
from tests.rollout_engine.engines import app_client, thread_engine

# Qwen2.5-7B-Instruct's generation_config.json sampling keys
QWEN25_INSTRUCT = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7,
                   "top_p": 0.8, "top_k": 20}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _with_generation_config(src: str, dst: Path, **keys: Any) -> str:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    return str(dst)


@pytest.fixture(scope="module")
def model_dir(qwen2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(qwen2_path, tmp_path_factory.mktemp("gen") / "model",
                                   **QWEN25_INSTRUCT)


class _Built:
    """Wraps the frontend's request building; keeps each call's first SamplingParams."""

    def __init__(self, engine: Any) -> None:
        self.build = engine.tm.build_requests
        self.params: list[SamplingParams] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reqs, single = self.build(*args, **kwargs)
        self.params.append(reqs[0].sampling_params)
        return reqs, single

    def last(self) -> tuple[Any, ...]:
        return tuple(getattr(self.params[-1], k) for k in KEYS)


def _served(model_dir: str, **flags: Any) -> Iterator[tuple[TestClient, _Built, Any]]:
    for engine in thread_engine(model_dir, context_length=256, **flags):
        built = _Built(engine)
        engine.tm.build_requests = built
        for client in app_client(engine):
            yield client, built, engine


@pytest.fixture(scope="module")
def model_defaults(model_dir: str) -> Iterator[tuple[TestClient, _Built, Any]]:
    yield from _served(model_dir)


@pytest.fixture(scope="module")
def openai_defaults(model_dir: str) -> Iterator[tuple[TestClient, _Built, Any]]:
    yield from _served(model_dir, sampling_defaults="openai")


PLAIN = (1.0, 1.0, -1, 0.0, 1.0)       # SamplingParams' defaults
MODEL = (0.7, 0.8, 20, 0.0, 1.05)      # the file's, min_p unset there


def test_chat_omitting_a_field_gets_the_models(model_defaults: Any) -> None:
    client, built, _ = model_defaults
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert built.last() == MODEL
    body = {**CHAT, "stream": True, "temperature": None}         # null: omitted
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert built.last() == MODEL


def test_an_explicit_value_wins_even_the_openai_default(model_defaults: Any) -> None:
    client, built, _ = model_defaults
    body = {**CHAT, "temperature": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert built.last() == (1.0, 0.8, -1, 0.0, 1.0)


def test_generate_completions_and_the_engine_keep_sglangs_defaults(model_defaults: Any
                                                                   ) -> None:
    client, built, engine = model_defaults
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and built.last() == PLAIN
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and built.last() == PLAIN
    engine.generate("hi", {"max_new_tokens": 2})
    assert built.last() == PLAIN


def test_sampling_defaults_openai_keeps_the_plain_defaults(openai_defaults: Any) -> None:
    client, built, _ = openai_defaults
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert built.last() == PLAIN


# -- reading generation_config.json -------------------------------------------------------------
@pytest.mark.parametrize("keys, defaults", [
    ({}, {}),
    (QWEN25_INSTRUCT, {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
                       "top_k": 20}),
    ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.0}),   # greedy, as SGLang
    ({"temperature": None, "top_k": 0, "min_p": 0.1}, {"top_k": -1, "min_p": 0.1}),
    ({"max_new_tokens": 64, "num_beams": 1}, {}),                      # not sampling defaults
], ids=["none", "qwen2.5-instruct", "do_sample-false", "hf-top_k-0", "other-keys"])
def test_which_keys_are_read(qwen2_path: str, tmp_path: Path, keys: dict[str, Any],
                             defaults: dict[str, Any]) -> None:
    assert read_sampling_defaults(_with_generation_config(qwen2_path, tmp_path / "m",
                                                          **keys)) == defaults


def test_no_generation_config_means_no_defaults(tmp_path: Path) -> None:
    assert read_sampling_defaults(str(tmp_path)) == {}


def test_a_bad_file_is_refused_at_launch_naming_it(qwen2_path: str, tmp_path: Path) -> None:
    model = _with_generation_config(qwen2_path, tmp_path / "m", top_p=1.5)
    with pytest.raises(ValueError, match=r"^EngineConfig.sampling_defaults: 'model' reads "
                       r".*generation_config.json: top_p: must be in \(0, 1\], got 1.5; fix "
                       r"the file or use 'openai'"):
        EngineConfig(model_path=model)
    assert EngineConfig(model_path=model, sampling_defaults="openai").sampling_defaults == \
        "openai"
    (Path(model) / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json: not readable as JSON"):
        EngineConfig(model_path=model)
