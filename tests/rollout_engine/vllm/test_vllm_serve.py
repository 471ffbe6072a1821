"""``rollout-engine vllm-serve MODEL [vllm serve flags]`` started as a vLLM user starts it: the
flags reach the server (model name, context length) and the OpenAI routes answer."""

from __future__ import annotations

import httpx
import pytest

from tests.rollout_engine.vllm.serve_process import vllm_serve


@pytest.mark.slow   # a server in a child process: tens of seconds on a loaded machine
def test_vllm_serve_live(qwen2_path: str) -> None:
    with vllm_serve(qwen2_path, "--max-model-len", "256", "--served-model-name", "foo",
                    "--max-num-seqs", "4", "--disable-log-stats") as (url,):
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("foo", 256)]
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "foo", "prompt": "Hello there", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "foo" and body["usage"]["completion_tokens"] == 5
        assert body["choices"][0]["finish_reason"] == "length"
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert (info["context_length"], info["max_running_requests"]) == (256, 4)
