"""prime-rl against the server, as its orchestrator drives a vLLM server.

The rollout client is real: ``renderers.client.generate`` (the token-in, token-out call that
verifiers' ``TrainClient`` makes for prime-rl) runs from a virtual environment with the pinned
``renderers`` release. The orchestrator's admin calls are replayed with the bodies its
``utils/client.py`` sends (that module imports prime-rl's own config package, which is not
published): ``/health``, ``/v1/models``, ``/init_broadcaster`` (a 404 is tolerated),
``/pause?mode=keep&clear_cache=false``, ``/update_weights {"weight_dir"}``, ``/resume``, the
fixed-name ``/load_lora_adapter`` reload, and the prefill scoring call
(``/inference/v1/generate`` with ``prompt_logprobs``).

A request frozen by ``/pause?mode=keep`` keeps its KV; after the update it continues on the new
weights. The reference for that is transformers: the old model's cache over the tokens before
the switch, then the new model decoding on top of it.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.rollout_engine.engines import served_over_http
from tests.rollout_engine.entrypoints.conftest import LiveServer
from tests.rollout_engine.hf_reference import hf_logprobs, hf_model
from tests.venvs import client_venv

RENDERERS = ["renderers==0.1.12"]
MODEL = "policy"


@pytest.fixture(scope="module")
def new_weights_dir() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2", seed=1))


@pytest.fixture(scope="module")
def server(qwen2_path: str) -> Iterator[LiveServer]:
    from rollout_engine import Engine

    engine = Engine(model_path=qwen2_path, dtype="float32", device="cpu", context_length=512,
                    scheduler_mode="process", served_model_name=MODEL)
    try:
        for url in served_over_http(engine):
            yield LiveServer(url, engine, None)
    finally:
        engine.shutdown()


RENDER_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer
    import renderers
    from renderers.client import generate

    url, model_dir, model = sys.argv[1:4]
    renderer = renderers.create_renderer(AutoTokenizer.from_pretrained(model_dir),
                                         renderers.DefaultRendererConfig())

    async def main():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY")
        out = []
        for text in ("hello there", "what is two plus two"):
            r = await generate(client=client, renderer=renderer, model=model,
                               messages=[{"role": "user", "content": text}],
                               sampling_params={"max_tokens": 12, "temperature": 0.0},
                               cache_salt="step-0")
            out.append({k: r[k] for k in ("prompt_ids", "completion_ids",
                                          "completion_logprobs", "finish_reason", "usage")})
        await client.close()
        print(json.dumps(out))

    asyncio.run(main())
""")


def test_rollouts_through_prime_rls_renderer_client(server: LiveServer, qwen2_path: str):
    python = client_venv("renderers-client", RENDERERS, system_site_packages=True)
    run = subprocess.run([str(python), "-c", RENDER_SCRIPT, server.url, qwen2_path, MODEL],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    rollouts = json.loads(run.stdout.strip().splitlines()[-1])
    with server.client() as c:
        for r in rollouts:
            ours = c.post("/generate", json={
                "input_ids": r["prompt_ids"], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0.0,
                                    "skip_special_tokens": False}}).json()
            assert r["completion_ids"] == ours["output_ids"]
            want = [lp for lp, _tid, _t in ours["meta_info"]["output_token_logprobs"]]
            got = r["completion_logprobs"]
            assert len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
            assert r["finish_reason"] in ("stop", "length")
            assert r["usage"]["completion_tokens"] == len(r["completion_ids"])
            assert r["usage"]["prompt_tokens"] == len(r["prompt_ids"])


def test_the_orchestrators_startup_calls(server: LiveServer):
    with server.client() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in models][:1] == [MODEL]
        assert models[0]["max_model_len"] == 512
        # prime-rl's NCCL broadcaster is its own worker extension: a 404 is what it tolerates
        r = c.post("/init_broadcaster", json={"host": "127.0.0.1", "port": 29500,
                                              "rank_offset": 0, "inference_world_size": 1,
                                              "timeout": 60,
                                              "quantize_in_weight_transfer": False})
        assert r.status_code == 404


def test_prefill_scoring_equals_transformers(server: LiveServer, qwen2_path: str):
    ids = [5, 17, 42, 99, 3, 250, 7, 61]
    with server.client() as c:
        r = c.post("/inference/v1/generate", json={
            "model": MODEL, "token_ids": ids,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                "prompt_logprobs": 1}})
    assert r.status_code == 200, r.text
    entries = r.json()["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    want = hf_logprobs(qwen2_path, ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        # the prompt token's own logprob is always in the entry (vLLM's rule)
        assert str(ids[i]) in entry
        assert abs(entry[str(ids[i])]["logprob"] - float(want[i])) <= 1e-4


@torch.inference_mode()
def _stale_kv_reference(old: str, new: str, prompt: list[int], before: list[int],
                        steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs when the cache over ``prompt + before[:-1]`` was
    written by the old model and every later forward runs the new one."""
    past = hf_model(old)(torch.tensor([prompt + before[:-1]]), use_cache=True).past_key_values
    model, last = hf_model(new), before[-1]
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(steps):
        out = model(torch.tensor([[last]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        last = int(lp.argmax())
        tokens.append(last)
        logprobs.append(float(lp[last]))
    return tokens, logprobs


def _poll(server: LiveServer, ready: Any) -> None:
    with server.client() as c:
        for _ in range(10_000):
            info = c.get("/get_server_info").json()
            if ready(info):
                return
    raise AssertionError("the rollouts never started")


def test_pause_keep_update_weights_resume(server: LiveServer, qwen2_path: str,
                                          new_weights_dir: str):
    """prime-rl's in-flight policy update: rollouts frozen mid-generation, the new weights
    loaded from a directory, a version label set, rollouts resumed; each finishes with two
    weight-version spans, its tokens before the switch equal an uninterrupted run and those
    after equal transformers continuing the old cache with the new model."""
    prompts = [[11 + i, 23, 5 * i + 7, 101, 64, 3 + i] for i in range(3)]
    n_tokens = 300
    sampling = {"max_tokens": n_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    with server.client(timeout=300) as c:
        plain = [c.post("/inference/v1/generate", json={
            "model": MODEL, "token_ids": p, "sampling_params": sampling}).json()
            for p in prompts]
        version = c.get("/get_weight_version").json()["weight_version"]
    results: list[Any] = [None] * len(prompts)

    def rollout(i: int) -> None:
        with server.client(timeout=300) as c:
            results[i] = c.post("/inference/v1/generate", json={
                "model": MODEL, "token_ids": prompts[i], "sampling_params": sampling,
                "cache_salt": "step-0"}).json()

    threads = [threading.Thread(target=rollout, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    _poll(server, lambda info: info["num_running_reqs"] == len(prompts))
    with server.client(timeout=300) as c:
        r = c.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert r.status_code == 200 and r.json() == {"status": "paused"}
        assert c.post("/update_weights", json={"weight_dir": new_weights_dir}).status_code == 200
        # the version label (prime-rl salts its cache instead; vLLM's native transfer sets it
        # at finish): SGLang's route, whose default aborts every request
        assert c.post("/update_weight_version", json={
            "new_version": "step-1", "abort_all_requests": False}).status_code == 200
        r = c.post("/resume")
        assert r.status_code == 200 and r.json() == {"status": "resumed"}
    for t in threads:
        t.join(300)
    try:
        for p, before, after in zip(prompts, plain, results):
            choice = after["choices"][0]
            spans = choice["weight_versions"]
            assert [s["version"] for s in spans] == [version, "step-1"], (spans, choice["finish_reason"], after)
            k = spans[0]["end"]
            assert spans[0]["start"] == 0 and spans[1]["start"] == k and 0 < k < n_tokens
            assert spans[1]["end"] == n_tokens
            tokens = choice["token_ids"]
            assert tokens[:k] == before["choices"][0]["token_ids"][:k]
            want, want_lp = _stale_kv_reference(qwen2_path, new_weights_dir, p, tokens[:k],
                                                n_tokens - k)
            assert tokens[k:] == want
            got_lp = [e["logprob"] for e in choice["logprobs"]["content"][k:]]
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) <= 1e-4
    finally:
        with server.client() as c:   # the next test starts from the old weights
            c.post("/update_weights", json={"weight_dir": qwen2_path})
    server.assert_no_leak()
