"""TRL 1.16's ``VLLMClient`` (``GRPOTrainer(use_vllm=True, vllm_mode="server")``) against our
server, unchanged: generate (n > 1, logprobs, token prompts, regex), chat, sequence logprobs,
world size, server info, prefix-cache reset, and the weight sync, after which greedy outputs
equal a fresh engine on the new weights.

TRL 1.16 serves nothing of its own: ``trl vllm-serve`` runs ``vllm serve`` (dev mode, NCCL
weight transfer, processed logprobs), and the client speaks vLLM's routes. The client needs an
importable ``vllm``; on this CPU machine that is trl_vllm_standin.py, which replaces vLLM's NCCL
trainer endpoint with the same broadcasts over gloo (vLLM's own builds a PyNcclCommunicator and
CUDA streams). The TRL virtual environment takes about half a minute to build, once per cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.rollout_engine.entrypoints.conftest import LiveServer, bound_socket, serve_app
from tests.rollout_engine.vllm import trl_vllm_standin
from tests.venvs import client_venv

# a real client in its own venv, a minute or so with the install: the long suite
pytestmark = pytest.mark.slow

__all__ = ["serve_app"]   # the fixture, imported for this package

REPO = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("trl_client_script.py")
PROMPTS = ["The capital of France is", "Once upon a time"]
MESSAGES = [[{"role": "user", "content": "Say hello."}],
            [{"role": "user", "content": "Count to three."}]]
MAX_TOKENS = 6


@pytest.fixture(scope="session")
def trl_python() -> Path:
    python = client_venv("trl-client", ["trl==1.16.0"], system_site_packages=True)
    trl_vllm_standin.install(trl_vllm_standin.site_packages_of(python))
    return python


def _server(model_path: str, serve: Any) -> tuple[LiveServer, Any]:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    # trl vllm-serve starts vLLM with --logprobs-mode processed_logprobs
    engine = Engine(model_path=model_path, dtype="float32", device="cpu", context_length=512,
                    scheduler_mode="thread", logprobs_mode="processed_logprobs")
    app = create_app(engine)
    return LiveServer(serve(app), engine, app), engine


@pytest.fixture(scope="module")
def trl_server(qwen2_path: str, serve_app: Any) -> Iterator[LiveServer]:
    server, engine = _server(qwen2_path, serve_app)
    try:
        yield server
    finally:
        engine.shutdown()


def run_client(python: Path, spec: dict[str, Any]) -> dict[str, Any]:
    run = subprocess.run([str(python), str(SCRIPT), json.dumps(spec)], capture_output=True,
                         text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def greedy(engine: Any, input_ids: list[int], max_tokens: int) -> dict[str, Any]:
    return engine.generate(input_ids=input_ids, return_logprob=True,
                           sampling_params={"temperature": 0, "max_new_tokens": max_tokens})


def test_server_info_carries_vllm_config(trl_server: LiveServer) -> None:
    """/server_info answers SGLang's flags and vLLM's ``vllm_config`` (json or text); TRL reads
    ``weight_transfer_config`` before it opens a communicator."""
    with trl_server.client() as c:
        tree = c.get("/server_info", params={"config_format": "json"}).json()
        text = c.get("/server_info").json()
        bad = c.get("/server_info", params={"config_format": "yaml"})
    assert tree["model_path"] == trl_server.engine.config.model_path   # SGLang's keys stay
    config = tree["vllm_config"]
    assert config["weight_transfer_config"] == {"backend": "gloo"}
    assert config["parallel_config"]["world_size_across_dp"] == 1
    assert config["model_config"]["max_model_len"] == 512
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert isinstance(text["vllm_config"], str) and "weight_transfer_config" in text["vllm_config"]
    assert bad.status_code == 400 and "config_format" in bad.json()["error"]["message"]


@pytest.fixture(scope="module")
def generated(trl_python: Path, trl_server: LiveServer) -> dict[str, Any]:
    return run_client(trl_python, {"url": trl_server.url, "prompts": PROMPTS,
                                   "messages": MESSAGES, "max_tokens": MAX_TOKENS})


def test_generate_greedy_equals_our_generate(generated: dict[str, Any],
                                             trl_server: LiveServer) -> None:
    out = generated["greedy"]
    tokenizer = trl_server.engine.tokenizer
    assert out["prompt_ids"] == [tokenizer.encode(p) for p in PROMPTS]
    assert len(out["completion_ids"]) == 2 * len(PROMPTS)   # prompt-major, n = 2
    for i, completion in enumerate(out["completion_ids"]):
        ours = greedy(trl_server.engine, out["prompt_ids"][i // 2], MAX_TOKENS)
        assert completion == ours["output_ids"]
        assert out["logprob_token_ids"][i] == [[t] for t in completion]
        expected = [lp for lp, _, _ in ours["meta_info"]["output_token_logprobs"]]
        assert [row[0] for row in out["logprobs"][i]] == pytest.approx(expected, abs=1e-4)


def test_generate_sampled_top_logprobs(generated: dict[str, Any]) -> None:
    """n = 3 with every sampling field TRL sends; logprobs = 2 gives up to 3 entries a token,
    the sampled one included, sorted by descending probability."""
    out = generated["sampled"]
    assert len(out["prompt_ids"]) == len(PROMPTS) and len(out["completion_ids"]) == 6
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"],
                                out["logprob_token_ids"], strict=True):
        assert 0 < len(ids) <= MAX_TOKENS and len(lps) == len(ids) == len(lp_ids)
        for token, row, row_ids in zip(ids, lps, lp_ids, strict=True):
            assert token in row_ids and 2 <= len(row_ids) <= 3
            assert row == sorted(row, reverse=True)


def test_generate_token_prompts_and_regex(generated: dict[str, Any],
                                          trl_server: LiveServer) -> None:
    out = generated["token_prompts"]
    assert out["prompt_ids"] == [[1, 2, 3, 4]] and out["logprobs"] is None
    assert out["completion_ids"][0] == greedy(trl_server.engine, [1, 2, 3, 4],
                                              MAX_TOKENS)["output_ids"]
    tokenizer = trl_server.engine.tokenizer
    text = tokenizer.decode(generated["regex"]["completion_ids"][0], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{3}", text), text


def test_chat_renders_the_template_and_decodes_greedily(generated: dict[str, Any],
                                                        trl_server: LiveServer) -> None:
    out = generated["chat"]
    tokenizer = trl_server.engine.tokenizer
    assert out["prompt_ids"] == [tokenizer.apply_chat_template(m, add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)
                                 for m in MESSAGES]
    for i, completion in enumerate(out["completion_ids"]):
        assert completion == greedy(trl_server.engine, out["prompt_ids"][i // 2],
                                    MAX_TOKENS)["output_ids"]
        assert len(out["logprobs"][i]) == len(completion)


def test_sequence_logprobs_score_the_completion(generated: dict[str, Any],
                                                trl_server: LiveServer) -> None:
    """get_sequence_logprobs (distillation): per completion position the top 3 (descending)
    and the actual token's logprob, equal to our prompt logprobs of the same sequence."""
    got, scored = generated["sequence_logprobs"], generated["scored"]
    for i, (seq, start) in enumerate(zip(scored["sequences"], scored["prompt_lengths"])):
        ref = trl_server.engine.generate(input_ids=seq, return_logprob=True, logprob_start_len=0,
                                         sampling_params={"temperature": 1.0,
                                                          "max_new_tokens": 1})
        expected = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"][start:]]
        assert got["actual_token_ids"][i] == [[t] for t in seq[start:]]
        assert [row[0] for row in got["actual_logprobs"][i]] == pytest.approx(expected,
                                                                              abs=1e-4)
        for row, ids in zip(got["logprobs"][i], got["logprob_token_ids"][i], strict=True):
            assert len(row) == len(ids) == 3 and row == sorted(row, reverse=True)


def test_world_size_and_prefix_cache_reset(generated: dict[str, Any]) -> None:
    assert generated["world_size"] == 1
    assert generated["weight_transfer_config"] == {"backend": "gloo"}
    assert generated["cached_before_reset"] > 0 and generated["cached_after_reset"] == 0


def test_weight_sync_then_greedy_equals_fresh_engine(trl_python: Path, qwen2_path: str,
                                                     trl_server: LiveServer, serve_app: Any,
                                                     tmp_path: Path) -> None:
    """init_communicator, update_model_params, a grouped weight_update, close_communicator:
    afterwards the server decodes exactly as an engine loaded from the new weights (and no
    longer as the old ones, ``trl_server``'s)."""
    from rollout_engine import Engine

    server, engine = _server(qwen2_path, serve_app)
    sock = bound_socket()
    group_port = sock.getsockname()[1]
    sock.close()
    try:
        got = run_client(trl_python, {"url": server.url, "prompts": PROMPTS,
                                      "max_tokens": MAX_TOKENS, "model_path": qwen2_path,
                                      "save_to": str(tmp_path / "new"), "seed": 3,
                                      "group_port": group_port})
    finally:
        engine.shutdown()
    after = got["after"]
    fresh = Engine(model_path=str(tmp_path / "new"), dtype="float32", device="cpu",
                   context_length=512, scheduler_mode="thread")
    try:
        expected = [greedy(fresh, ids, MAX_TOKENS)["output_ids"] for ids in after["prompt_ids"]]
    finally:
        fresh.shutdown()
    before = [greedy(trl_server.engine, ids, MAX_TOKENS)["output_ids"]
              for ids in after["prompt_ids"]]
    assert after["completion_ids"] == expected
    assert expected != before   # the perturbation changes the decode, so the sync is seen
