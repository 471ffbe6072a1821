"""The real SGLang clients against our servers: the sglang-router (its Rust binary, cache_aware
policy) in front of two of our servers, and SGLang's frontend language (``sglang.lang`` with
``RuntimeEndpoint``) running gen, select, fork and batched programs.

Both are pip packages with dependencies of their own, so they live in a separate virtual
environment that the ``clients_venv`` fixture creates once per cache directory (the project's own
environment stays clean; ``sglang`` is pinned to 0.5.2, whose frontend installs without CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.rollout_engine.entrypoints.conftest import LiveServer, bound_socket
from tests.venvs import client_venv

CLIENT_PACKAGES = ["sglang==0.5.2", "sglang-router==0.3.2", "pybase64"]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="session")
def clients_venv() -> Path:
    return client_venv("clients-venv", CLIENT_PACKAGES)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def second_server(tiny_paths: dict[str, str], serve_app: Any) -> Iterator[LiveServer]:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    context_length=512, scheduler_mode="thread")
    app = create_app(engine)
    try:
        yield LiveServer(serve_app(app), engine, app)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def router(clients_venv: Path, live_server: LiveServer, second_server: LiveServer
           ) -> Iterator[str]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = open(Path(os.environ.get("ROLLOUT_ENGINE_CACHE", "/tmp")) / "router.log", "w")
    proc = subprocess.Popen(
        [str(clients_venv), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", "cache_aware",
         "--worker-urls", live_server.url, second_server.url,
         "--worker-startup-timeout-secs", "60"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_router_routes_generate_text_and_chat(router: str, live_server: LiveServer,
                                               second_server: LiveServer) -> None:
    direct = live_server.engine.generate(prompt="The capital of", sampling_params=GREEDY)
    with httpx.Client(base_url=router, timeout=60) as c:
        r = c.post("/generate", json={"text": "The capital of", "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == direct["output_ids"]
        assert r.json()["text"] == direct["text"]

        r = c.post("/v1/completions", json={"model": "default", "prompt": "The capital of",
                                            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == direct["text"]

        r = c.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"

        # cache_aware: a repeated long prefix goes where its KV is cached
        prefix = "tell me a story about " * 12
        outs = [c.post("/generate", json={"text": prefix + tail, "sampling_params": GREEDY})
                for tail in ("a cat", "a dog", "a fox", "a cow")]
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
    assert all(o.json()["meta_info"]["cached_tokens"] > 0 for o in outs[1:])


FRONTEND_PROGRAM = textwrap.dedent('''
    import json, sys
    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    @sgl.function
    def pick(s):
        s += "My favourite colour is"
        s += sgl.select("colour", choices=[" red", " green", " blue"])

    @sgl.function
    def forked(s):
        s += "Once upon a time"
        branches = s.fork(2)
        for i, b in enumerate(branches):
            b += f" in land {i}," + sgl.gen("story", max_tokens=4, temperature=0)
        branches.join()
        s += " The end."

    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
    one = qa.run(question="what is two plus two?")
    batch = qa.run_batch([{"question": "why?"}, {"question": "how?"}], num_threads=2)
    chosen = pick.run()
    tree = forked.run()
    print(json.dumps({
        "answer": one["answer"], "batch": [b["answer"] for b in batch],
        "colour": chosen["colour"],
        "stories": [tree.text()],
    }))
''')


def test_sglang_frontend_language(clients_venv: Path, live_server: LiveServer,
                                  tmp_path: Path) -> None:
    script = tmp_path / "program.py"
    script.write_text(FRONTEND_PROGRAM)
    run = subprocess.run([str(clients_venv), str(script), live_server.url],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    engine = live_server.engine

    def greedy_text(prompt: str, n: int) -> str:
        return engine.generate(prompt=prompt, sampling_params={"temperature": 0,
                                                               "max_new_tokens": n})["text"]

    assert got["answer"] == greedy_text("Q: what is two plus two?\nA:", 8)
    assert got["batch"] == [greedy_text("Q: why?\nA:", 8), greedy_text("Q: how?\nA:", 8)]
    assert got["colour"] in (" red", " green", " blue")
    assert got["stories"][0].startswith("Once upon a time") and got["stories"][0].endswith(
        "The end.")


STRUCTURED_PROGRAM = textwrap.dedent('''
    import json, sys
    import sglang as sgl

    SCHEMA = json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]})

    @sgl.function
    def structured(s, temperature):
        s += "Phone number:" + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16,
                                       temperature=temperature)
        s += "\\nPerson:" + sgl.gen("person", json_schema=SCHEMA, max_tokens=64,
                                      temperature=temperature)

    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
    runs = structured.run_batch([{"temperature": 0}, {"temperature": 1.0}], num_threads=2)
    print(json.dumps([{"phone": r["phone"], "person": r["person"]} for r in runs]))
''')


@pytest.fixture(scope="module")
def grammar_server(tiny_paths: dict[str, str], serve_app: Any) -> Iterator[LiveServer]:
    from rollout_engine import Engine
    from rollout_engine.entrypoints.http_server import create_app

    # compact JSON: a random model given any whitespace emits it forever under greedy decoding
    engine = Engine(model_path=tiny_paths["qwen2"], dtype="float32", device="cpu",
                    context_length=512, scheduler_mode="thread",
                    constrained_json_disable_any_whitespace=True)
    app = create_app(engine)
    try:
        yield LiveServer(serve_app(app), engine, app)
    finally:
        engine.shutdown()


def test_sglang_frontend_regex_and_json_schema(clients_venv: Path, grammar_server: LiveServer,
                                               tmp_path: Path) -> None:
    """sgl.gen(regex=...) and sgl.gen(json_schema=...), greedy and sampled: the random model's
    outputs match and validate."""
    import re

    import jsonschema

    script = tmp_path / "structured.py"
    script.write_text(STRUCTURED_PROGRAM)
    run = subprocess.run([str(clients_venv), str(script), grammar_server.url],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
    for got in json.loads(run.stdout.strip().splitlines()[-1]):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", got["phone"]), got
        jsonschema.validate(json.loads(got["person"]), schema)
