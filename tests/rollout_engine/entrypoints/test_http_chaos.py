"""HTTP chaos: the server as RL frameworks drive it, in its own process, on a tiny KV pool.

Several client threads send plain, ``n > 1``, streaming, dropped-midway, oversized, OpenAI
completion and chat requests while one controller makes random control calls (every pause mode
and continue, refits from disk and by tensor handles between two checkpoints, release / resume,
flush, abort all, version bumps) and a prober polls ``/health``.

It asserts: every request ends within a bound; no 5xx but 503 / 504 (and each kind of request
gets only the statuses it may); ``/health`` answers 200 within a second throughout; a greedy
probe after every refit equals a fresh engine on that checkpoint; afterwards the KV invariant
holds, nothing is left in ``/dev/shm``, the server's memory is back near its baseline, and
SIGTERM stops the server and its scheduler within 10 s. The default run lasts ~30 s; the
``slow`` one 10 minutes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import pytest

from tests.rollout_engine.entrypoints.chaos_actors import (
    CLIENT_KINDS,
    GREEDY,
    POOL_TOKENS,
    PROBES,
    REQUEST_TIMEOUT_S,
    RSS_SLACK,
    RSS_SLACK_BYTES,
    STOP_BOUND_S,
    Chaos,
    _shm_entries,
)
from tests.rollout_engine.entrypoints.conftest import bound_socket
from tests.rollout_engine.entrypoints.test_launch_server import _wait_healthy


@pytest.fixture(scope="module")
def checkpoints(tiny_paths: dict[str, str]) -> dict[str, Any]:
    """The two checkpoints, their tensors, and a fresh engine's probe answers on each."""
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path
    from rollout_engine.weights.loader import iter_safetensors

    paths = {"w1": tiny_paths["qwen2"], "w2": str(tiny_model_path("qwen2", seed=1))}
    reference = {}
    for key, path in paths.items():
        with Engine(model_path=path, scheduler_mode="thread", device="cpu",
                    dtype="float32") as fresh:
            answers = []
            for ids in PROBES:
                o = fresh.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
                answers.append((o["output_ids"],
                                [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]))
            reference[key] = answers
    tensors = {k: list(iter_safetensors(p)) for k, p in paths.items()}
    return {"paths": paths, "reference": reference, "tensors": tensors}


def _rss(procs: list[psutil.Process]) -> int:
    return sum(p.memory_info().rss for p in procs)


def _chaos(world: dict[str, Any], tmp_path: Any, seconds: float, clients: int = 6) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_engine.launch_server", "--model-path",
             world["paths"]["w1"], "--port", str(port), "--dtype", "float32", "--device", "cpu",
             "--max-total-tokens", str(POOL_TOKENS), "--chunked-prefill-size", "64",
             "--max-running-requests", "8", "--random-seed", "0"],
            stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout=300)
        server = psutil.Process(proc.pid)
        procs = [server, *server.children(recursive=True)]
        ours = {os.getpid(), *(p.pid for p in procs)}
        shm_before = _shm_entries(ours)
        chaos = Chaos(url, world, seconds, seed=int(os.environ.get("CHAOS_SEED", "0")))
        warm = Chaos(url, world, 0, seed=1)   # every kind once, serially: the baseline's memory
        with warm.client() as c:
            warm.c = c
            for kind in CLIENT_KINDS:
                warm._one(c, random.Random(kind), kind)
            warm._disk(random.Random(0))
            warm._tensor(random.Random(1))
            warm._checked(random.Random(2))   # a weights snapshot is held from here on
            warm._profile(random.Random(3))
            warm._refit("disk", "w1")
        assert not warm.tally.failures, warm.tally.failures
        rss_before = _rss(procs)

        threads = [threading.Thread(target=chaos.run_client, args=(i,), daemon=True)
                   for i in range(clients)]
        threads += [threading.Thread(target=chaos.run_controller, daemon=True),
                    threading.Thread(target=chaos.run_health, daemon=True)]
        for t in threads:
            t.start()
        bound = seconds + REQUEST_TIMEOUT_S + 120
        for t in threads:
            t.join(max(1.0, bound - (time.monotonic() - (chaos.deadline - seconds))))
        chaos.stop.set()
        hung = [t.name for t in threads if t.is_alive()]

        # back to a known state: awake, serving w1, idle, nothing cached
        with chaos.client() as c:
            chaos.c = c
            chaos.post("/continue_generation")
            chaos.post("/resume_memory_occupation")
            chaos._refit("disk", "w1")
            deadline = time.monotonic() + 60
            while True:
                info = c.get("/get_server_info").json()
                if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                    break
                assert time.monotonic() < deadline, f"never idle: {info}"
                time.sleep(0.05)
            report = c.get("/check_integrity").json()["result"]
            assert c.post("/flush_cache").status_code == 200
        rss_after = _rss(procs)
        shm_left = _shm_entries(ours) - shm_before
        t = chaos.tally
        print(f"\nHTTP chaos {seconds:g} s: requests {sum(v for k, v in t.counts.items() if ':' in k and not k.startswith(('control', 'refit', 'release')))}"
              f", control calls {sum(v for k, v in t.counts.items() if k.startswith('control:'))}"
              f", refits {t.counts['refit']}, probes {t.counts['probe']}, releases "
              f"{t.counts['released']}, health polls {t.counts['health']} (worst "
              f"{t.health_worst_s * 1000:.0f} ms); RSS {rss_before / 2**20:.0f} -> "
              f"{rss_after / 2**20:.0f} MiB; /dev/shm left {len(shm_left)}\n"
              f"{dict(sorted(t.counts.items()))}")
        assert not hung, f"threads still running past the bound: {hung}"
        assert not t.failures, t.failures[:20]
        assert t.counts["probe"] > 0 and t.counts["health"] > 0
        assert report["idle"] and report["owned_tokens"] == 0
        assert not shm_left, sorted(shm_left)
        assert rss_after <= rss_before * RSS_SLACK + RSS_SLACK_BYTES, (rss_before, rss_after)

        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(STOP_BOUND_S)
        psutil.wait_procs(procs[1:], timeout=max(0.1, STOP_BOUND_S - (time.monotonic() - sent)))
        assert not [p.pid for p in procs[1:] if p.is_running() and p.status() != "zombie"]
        assert time.monotonic() - sent < STOP_BOUND_S
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()


def test_http_chaos_short(checkpoints: dict[str, Any], tmp_path: Any) -> None:
    _chaos(checkpoints, tmp_path, seconds=30)


@pytest.mark.slow
def test_http_chaos_ten_minutes(checkpoints: dict[str, Any], tmp_path: Any) -> None:
    _chaos(checkpoints, tmp_path, seconds=600)
