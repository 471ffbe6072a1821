"""The command line (flags from EngineConfig, ``rollout-engine serve``) and the server process's
life: it exits non-zero when its scheduler dies, answering /health 503 until then."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rollout_engine.compat.server_args import IGNORED_ARGS_FIELD, SGLANG_FLAGS
from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints import cli
from rollout_engine.entrypoints.launch_server import HELP, build_parser, parse_args
from tests.rollout_engine.entrypoints.conftest import bound_socket


def test_every_config_field_is_a_flag_with_help() -> None:
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    # (ignored_sglang_args is filled from SGLang's own flags: it is no flag itself)
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {IGNORED_ARGS_FIELD}
    # our fields, and every SGLang flag (compat/server_args.py), nothing else
    assert set(flags) == fields | set(SGLANG_FLAGS)
    assert set(HELP) == fields, "every flag of ours has its own help text"
    for name in set(SGLANG_FLAGS) - fields:
        assert flags[name].help == argparse.SUPPRESS, f"{name}: SGLang's flags stay out of --help"
    assert "--model-path" in flags["model_path"].option_strings
    assert "--model" in flags["model_path"].option_strings       # SGLang's alias
    assert "--page-size" in flags["page_size"].option_strings
    assert "--disable-radix-cache" in flags["disable_radix_cache"].option_strings


def test_parse_args_types_and_defaults() -> None:
    kw = parse_args(["--model-path", "/m", "--page-size", "16", "--disable-radix-cache",
                     "--mem-fraction-static", "0.5", "--api-key", "k", "--attention-backend",
                     "torch_native"])
    assert kw == {"model_path": "/m", "page_size": 16, "disable_radix_cache": True,
                  "mem_fraction_static": 0.5, "api_key": "k", "attention_backend": "torch_native"}
    with pytest.raises(SystemExit):
        parse_args(["--page-size", "16"])          # --model-path is required
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/m", "--page-size", "x"])


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    assert "rollout-engine serve" in capsys.readouterr().out
    assert cli.main(["serve", "--model-path", "/does/not/exist"]) == 2


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def test_scheduler_death_fails_requests_and_exits_nonzero(tiny_paths: dict[str, str]) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_engine.launch_server", "--model-path",
         tiny_paths["qwen2"], "--port", str(port), "--dtype", "float32", "--device", "cpu",
         "--dead-scheduler-exit-delay", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(url, proc)
        info = httpx.get(url + "/get_server_info").json()
        assert info["host"] == "127.0.0.1"
        body = {"text": "keep going", "sampling_params": {"max_new_tokens": 1000,
                                                          "ignore_eos": True}}
        outcome: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", url + "/generate", json={**body, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: {") and '"error"' in line:
                        outcome["stream_error"] = json.loads(line[6:])["error"]
                        outcome["stream_error_at"] = time.time()

        def blocking() -> None:
            r = httpx.post(url + "/generate", json=body, timeout=60)
            outcome["status"], outcome["status_at"] = r.status_code, time.time()

        threads = [threading.Thread(target=stream), threading.Thread(target=blocking)]
        for t in threads:
            t.start()
        assert started.wait(30)
        killed_at = time.time()
        os.kill(info["scheduler_pid"], signal.SIGKILL)
        health = []
        while proc.poll() is None and time.time() - killed_at < 30:
            try:
                health.append(httpx.get(url + "/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 1
        assert 503 in health and 200 not in health[health.index(503):]
        assert outcome["status"] == 503 and outcome["status_at"] - killed_at < 5
        assert "scheduler died" in outcome["stream_error"]["message"]
        assert outcome["stream_error_at"] - killed_at < 5
        assert "the scheduler died" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
