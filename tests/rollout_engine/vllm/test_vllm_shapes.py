"""This server's answers on vLLM's routes validate with vLLM's own response models (run in a
vLLM environment: slow)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.rollout_engine.engines import app_client, thread_engine
from tests.rollout_engine.vllm.vllm_venv import vllm_python

PROMPT = [5, 6, 7, 8]


def _answers(client: Any) -> dict[str, Any]:
    def post(route: str, body: dict[str, Any]) -> Any:
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    out = {
        "generate": post("/inference/v1/generate", {
            "token_ids": PROMPT, "return_token_ids": True,
            "sampling_params": {"max_tokens": 3, "logprobs": 2, "prompt_logprobs": 1, "n": 2}}),
        "generate_text": post("/inference/v1/generate", {
            "token_ids": PROMPT, "output_mode": "text",
            "sampling_params": {"max_tokens": 3, "logprobs": 2}}),
        "completion": post("/v1/completions", {
            "prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "prompt_logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}),
        "chat": post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1, "prompt_logprobs": 1, "return_token_ids": True}),
        "tokenize": post("/tokenize", {"prompt": "hello", "return_token_strs": True}),
        "detokenize": post("/detokenize", {"tokens": PROMPT}),
        "models": client.get("/v1/models").json(),
    }
    with client.stream("POST", "/inference/v1/generate", json={
            "token_ids": PROMPT, "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 3, "logprobs": 1}}) as r:
        out["generate_stream"] = [json.loads(line[6:]) for line in r.iter_lines()
                                  if line.startswith("data: ") and line != "data: [DONE]"]
    return out


@pytest.mark.slow
def test_answers_validate_with_vllms_models(qwen2_path: str, tmp_path: Path) -> None:
    from benchmarks.vllm_peer import vllm_env

    for engine in thread_engine(qwen2_path):
        for client in app_client(engine):
            answers = _answers(client)
    spec = tmp_path / "answers.json"
    spec.write_text(json.dumps(answers))
    peer = Path(__file__).with_name("vllm_shapes_peer.py")
    run = subprocess.run([vllm_python(), str(peer), str(spec)], capture_output=True, text=True,
                         env=vllm_env(), timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "ALL OK"
