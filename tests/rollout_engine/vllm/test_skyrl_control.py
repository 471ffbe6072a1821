"""SkyRL's own ``RemoteInferenceClient`` (pip ``skyrl`` 0.4.0) driving the control routes of a
live server: ``pause`` (keep, as SkyRL pauses for a refit), ``reset_prefix_cache``, ``resume``,
then ``sleep(level=2)``, a staged ``wake_up`` with a refit between, and a second keep pause.

skyrl 0.4.0 declares Python >= 3.12, and its ``skyrl.backends`` package ``__init__`` imports the
Tinker backend, whose pydantic ``TypedDict`` models need 3.12; the remote client module itself
runs on 3.11. So the client's venv (this interpreter, system site packages for torch / numpy /
pydantic) installs skyrl and the client's own imports without dependency resolution, and the
client script imports the client module with that package ``__init__`` bypassed.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.rollout_engine.vllm.control_server import (
    PROMPTS,
    greedy,
    served,
    stream_generate,
    w1_w2,
    wait_running,
)
from tests.venvs import client_venv

# a real client in its own venv, a minute or so with the install: the long suite
pytestmark = pytest.mark.slow

LONG = 300
# "--ignore-requires-python" travels with the package list to pip (client_venv appends it)
SKYRL_PACKAGES = ["--ignore-requires-python", "skyrl==0.4.0", "aiohttp", "aiosignal",
                  "aiohappyeyeballs", "frozenlist", "multidict", "propcache", "yarl",
                  "orjson", "pybase64", "cloudpathlib", "loguru"]

CLIENT = r'''
import asyncio, json, pathlib, sys, types
import skyrl
backends = types.ModuleType("skyrl.backends")
backends.__path__ = [str(pathlib.Path(skyrl.__file__).parent / "backends")]
sys.modules["skyrl.backends"] = backends
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (

    RemoteInferenceClient)

url, w1, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


def say(step, answer):
    print(json.dumps({"step": step, "answer": answer[url]}), flush=True)


async def main():
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1,
                                   model_name=w1)
    out = await client.generate({"prompt_token_ids": [prompt], "sampling_params": {
        "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}})
    ids = await client.tokenize(["hello world"])
    print(json.dumps({"step": "generate", "answer": {
        "response_ids": out["response_ids"], "responses": out["responses"],
        "response_logprobs": out["response_logprobs"], "stop_reasons": out["stop_reasons"],
        "tokenized": ids, "detokenized": await client.detokenize(ids)}}), flush=True)
    print(json.dumps({"step": "ready"}), flush=True)
    sys.stdin.readline()                                 # a request is decoding
    say("pause", await client.pause())                  # SkyRL's default: keep, no clear
    say("reset", await client.reset_prefix_cache())
    say("relabel", await client._call_all_servers(
        "/update_weight_version", {"new_version": "v2", "abort_all_requests": False}))
    say("resume", await client.resume())
    sys.stdin.readline()                                 # that request finished
    say("sleep", await client.sleep(level=2))
    say("wake_weights", await client.wake_up(["weights"]))
    say("refit", await client._call_all_servers("/update_weights_from_disk",
                                                {"model_path": w1}))
    say("wake_kv", await client.wake_up(["kv_cache"]))
    say("pause_generation", await client.pause_generation())
    say("resume_generation", await client.resume_generation())
    await client.aclose()

asyncio.run(main())
'''


@pytest.fixture(scope="module")
def skyrl_python() -> Path:
    return client_venv("skyrl-venv", SKYRL_PACKAGES, system_site_packages=True, no_deps=True)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    yield from served(w1_w2()[0])


def _next(proc: subprocess.Popen) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith('{"step"'):   # the client's own log lines
        line = proc.stdout.readline()
    assert line, f"the SkyRL client exited: {proc.wait(30)}; {proc.stderr.read()}"
    answer: dict[str, Any] = json.loads(line)
    return answer


def test_skyrl_client_pauses_refits_sleeps_and_wakes(skyrl_python, server, tmp_path):
    url, engine = server
    script = tmp_path / "skyrl_client.py"
    script.write_text(CLIENT)
    with httpx.Client(base_url=url, timeout=60) as http:
        before = http.post("/generate", json={"input_ids": PROMPTS[1], "return_logprob": True,
                                              "sampling_params": greedy(12)}).json()
    proc = subprocess.Popen([str(skyrl_python), str(script), url, w1_w2()[0],
                             json.dumps(PROMPTS[1])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        generated = _next(proc)   # generate over /inference/v1/generate, then /tokenize
        assert generated["step"] == "generate"
        got = generated["answer"]
        assert got["response_ids"] == [before["output_ids"]]
        assert got["responses"] == [before["text"]]
        assert got["stop_reasons"] == ["length"]
        want = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got["response_logprobs"][0], want)) <= 1e-5
        assert got["detokenized"] == ["hello world"]
        assert _next(proc) == {"step": "ready"}
        t, box = stream_generate(url, PROMPTS[0], "skyrl", n=LONG)
        wait_running(engine, 1)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        steps = [_next(proc) for _ in range(4)]
        assert [s["step"] for s in steps] == ["pause", "reset", "relabel", "resume"]
        assert steps[0]["answer"] == {"status": 200, "body": {"status": "paused"}}
        # the frozen request holds KV: vLLM answers success false (SkyRL reads no flag)
        assert steps[1]["answer"] == {"status": 200, "body": {"success": False}}
        assert steps[3]["answer"] == {"status": 200, "body": {"status": "resumed"}}
        t.join(60)
        meta = box["final"]["meta_info"]
        assert len(box["final"]["output_ids"]) == LONG
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "v2"]
        assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < LONG
        proc.stdin.write("go\n")
        proc.stdin.flush()
        steps = [_next(proc) for _ in range(6)]
        assert steps[0]["answer"]["body"] == {"status": "sleeping", "level": 2}
        assert steps[1]["answer"]["body"] == {"status": "sleeping", "tags": ["weights"]}
        assert steps[2]["answer"]["status"] == 200
        assert steps[3]["answer"]["body"] == {"status": "awake", "tags": ["kv_cache"]}
        assert steps[4]["answer"]["body"] == {"status": "paused"}
        assert steps[5]["answer"]["body"] == {"status": "resumed"}
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    with httpx.Client(base_url=url, timeout=60) as http:
        after = http.post("/generate", json={"input_ids": PROMPTS[1],
                                             "sampling_params": greedy(12)}).json()
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert after["output_ids"] == before["output_ids"]
    engine.check_integrity()
