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

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import psutil
import pytest

from tests.rollout_engine.entrypoints.conftest import bound_socket
from tests.rollout_engine.entrypoints.test_launch_server import _wait_healthy

POOL_TOKENS = 384
REQUEST_TIMEOUT_S = 90.0     # a request that has not ended by then hung
HEALTH_BOUND_S = 1.0
STOP_BOUND_S = 10.0
PROBES = [[5 + i for i in range(30)], [7, 9, 11] * 6, [300, 301, 302, 303]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
LOGPROB_TOL = 1e-4           # other requests share the batch: matmul order moves
RSS_SLACK = 1.25             # allocator caches and arenas: end RSS <= baseline x this + 64 MiB
RSS_SLACK_BYTES = 64 << 20
CLIENT_KINDS = ("plain", "n", "stream", "drop", "oversized", "completions", "chat",
                "chat_drop")
SERVE_OK = {200, 503}        # 503: asleep or weights stale while the controller sleeps it


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    health_worst_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


def _probe(post: Any) -> list[tuple[list[int], list[float], Optional[str]]]:
    out = []
    for ids in PROBES:
        r = post("/generate", {"input_ids": ids, "sampling_params": GREEDY,
                               "return_logprob": True})
        assert r.status_code == 200, r.text
        o = r.json()
        out.append((o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]],
                    o["meta_info"]["weight_version"]))
    return out


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


def _shm_entries(pids: set[int]) -> set[str]:
    """/dev/shm entries made by these processes (torch names them torch_<pid>_...), or by no
    process the name identifies."""
    out = set()
    for name in os.listdir("/dev/shm"):
        m = re.match(r"torch_(\d+)_", name)
        if m is None or int(m.group(1)) in pids:
            out.add(name)
    return out


class Chaos:
    def __init__(self, url: str, world: dict[str, Any], seconds: float, seed: int) -> None:
        self.url = url
        self.world = world
        self.deadline = time.monotonic() + seconds
        self.seed = seed
        self.tally = Tally()
        self.model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        self.weights = "w1"        # the checkpoint the server serves
        self.version: Optional[str] = None
        self.stop = threading.Event()
        self.traces = tempfile.mkdtemp(prefix="chaos-traces-")   # /start_profile writes here

    def client(self, timeout: float = REQUEST_TIMEOUT_S) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    # -- clients -------------------------------------------------------------------------------
    def run_client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with self.client() as c:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                kind = rng.choice(CLIENT_KINDS)
                try:
                    self._one(c, rng, kind, rid_prefix=f"c{index}-")
                except httpx.TimeoutException:
                    self.tally.fail(f"{kind}: no answer within {REQUEST_TIMEOUT_S:g} s")
                except httpx.HTTPError as e:
                    self.tally.fail(f"{kind}: {type(e).__name__}: {e}")

    def _one(self, c: httpx.Client, rng: random.Random, kind: str,
             rid_prefix: Optional[str] = None) -> None:
        ids = [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
        sp = {"max_new_tokens": rng.randint(0, 40), "temperature": rng.choice([0.0, 1.0])}
        status: Optional[int] = None
        if kind in ("plain", "n", "oversized"):
            if kind == "n":
                sp["n"] = 3
            if kind == "oversized":
                ids = list(range(5, 5 + POOL_TOKENS + 50))
            rid = None if rid_prefix is None else f"{rid_prefix}{rng.getrandbits(48):x}"
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": sp, "rid": rid,
                                          "return_logprob": rng.random() < 0.5})
            status = r.status_code
            if status == 200:
                outs = r.json() if kind == "n" else [r.json()]
                assert len(outs) == (3 if kind == "n" else 1)
                for o in outs:
                    if len(o["output_ids"]) > sp["max_new_tokens"]:
                        self.tally.fail(f"{kind}: more tokens than max_new_tokens")
        elif kind in ("stream", "drop"):
            with c.stream("POST", "/generate", json={
                    "input_ids": ids, "sampling_params": sp, "stream": True,
                    "return_logprob": True}) as r:
                status = r.status_code
                status = self._read_sse(r, kind, 2 if kind == "drop" else None) or status
        elif kind == "completions":
            r = c.post("/v1/completions", json={"model": self.model, "prompt": "a b c d " * 3,
                                                "max_tokens": rng.randint(1, 24), "logprobs": 2,
                                                "temperature": 1.0})
            status = r.status_code
        else:   # chat, chat_drop: OpenAI chat, streaming (dropped after two chunks) or not
            body = {"model": self.model, "max_tokens": rng.randint(1, 24),
                    "messages": [{"role": "user", "content": "say something"}],
                    "stream": kind == "chat_drop" or rng.random() < 0.5, "logprobs": True}
            if body["stream"]:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    status = r.status_code
                    status = self._read_sse(r, kind, 2 if kind == "chat_drop" else None) or status
            else:
                status = c.post("/v1/chat/completions", json=body).status_code
        allowed = {400, 503} if kind == "oversized" else SERVE_OK
        if status not in allowed:
            self.tally.fail(f"{kind}: status {status}")
        self.tally.count(f"{kind}:{status}")

    def _read_sse(self, r: httpx.Response, kind: str, stop_after: Optional[int]) -> Optional[int]:
        """Read a stream (to the end, or ``stop_after`` events then drop it); an error event's
        code, if one came."""
        if r.status_code != 200:
            r.read()
            return None
        events = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None
            event = json.loads(line[6:])
            if "error" in event:
                return int(event["error"].get("code", 500))
            events += 1
            if stop_after is not None and events >= stop_after:
                return None   # dropped: leaving the block closes the connection mid-stream
        if stop_after is None:
            self.tally.fail(f"{kind}: the stream ended without [DONE]")
        return None

    # -- /health -----------------------------------------------------------------------------
    def run_health(self) -> None:
        with self.client(timeout=HEALTH_BOUND_S) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as e:
                    self.tally.fail(f"/health: {type(e).__name__} (no answer in "
                                    f"{HEALTH_BOUND_S:g} s)")
                    continue
                took = time.monotonic() - t0
                self.tally.health_worst_s = max(self.tally.health_worst_s, took)
                if status != 200:
                    self.tally.fail(f"/health: {status}")
                self.tally.count("health")
                self.stop.wait(0.1)   # the polling period, not a synchronisation

    # -- controller ----------------------------------------------------------------------------
    def run_controller(self) -> None:
        rng = random.Random(self.seed)
        with self.client() as c:
            self.c = c
            while time.monotonic() < self.deadline:
                action = rng.choice(["pause", "disk", "tensor", "sleep", "flush", "abort_all",
                                     "version", "checked", "profile", "abort_prefix"])
                try:
                    getattr(self, "_" + action)(rng)
                except AssertionError as e:
                    self.tally.fail(f"controller {action}: {e}")
                except httpx.HTTPError as e:
                    self.tally.fail(f"controller {action}: {type(e).__name__}: {e}")
                self.tally.count(f"control:{action}")
            self.stop.set()

    def post(self, path: str, body: Optional[dict[str, Any]] = None) -> httpx.Response:
        r = self.c.post(path, json=body or {})
        assert r.status_code < 500 or r.status_code in (503, 504), f"{path}: {r.status_code}"
        return r

    def _pause(self, rng: random.Random) -> None:
        mode = rng.choice(["abort", "retract", "in_place"])
        assert self.post("/pause_generation", {"mode": mode}).status_code == 200
        if rng.random() < 0.5:
            assert self.post("/flush_cache").status_code in (200, 409)
        assert self.post("/continue_generation").status_code == 200

    def _refit(self, how: str, ckpt: str) -> None:
        """Refit to ``ckpt`` (pausing with abort when the server is busy), then probe."""
        self.version = f"{ckpt}-{self.tally.counts['refit']}"
        for _ in range(5):
            if how == "disk":
                r = self.post("/update_weights_from_disk", {
                    "model_path": self.world["paths"][ckpt], "weight_version": self.version})
            else:
                r = self._post_tensors(ckpt, self.version)
            if r.status_code == 200:
                self.weights = ckpt
                self.tally.count("refit")
                self._check_probe(f"after a {how} refit to {ckpt}")
                return
            self.tally.count(f"refit:{r.status_code}")
            assert r.status_code in (409, 504), r.text
        raise AssertionError(f"a {how} refit did not succeed in 5 tries: {r.text}")

    def _post_tensors(self, ckpt: str, version: str) -> httpx.Response:
        """A refit by shared-memory handles of fresh storages, as a trainer's new weights are:
        what it lends must be gone from /dev/shm once both sides are done with it."""
        from rollout_engine.protocol.payload_sender import serialize_named_tensors

        named = [(n, t.clone()) for n, t in self.world["tensors"][ckpt]]
        payload = serialize_named_tensors(named)   # the storages stay alive until answered
        r = self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "weight_version": version})
        del named, payload
        return r

    def _check_probe(self, where: str) -> None:
        got = _probe(self.post)
        for (ids, lps, version), (want_ids, want_lps) in zip(
                got, self.world["reference"][self.weights]):
            assert ids == want_ids, f"{where}: greedy {ids} != fresh engine's {want_ids}"
            worst = max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0)
            assert worst <= LOGPROB_TOL, f"{where}: logprobs off by {worst:.2e}"
            assert version == self.version, f"{where}: weight_version {version}"
        self.tally.count("probe")

    def _disk(self, rng: random.Random) -> None:
        self._refit("disk", rng.choice(["w1", "w2"]))

    def _tensor(self, rng: random.Random) -> None:
        self._refit("tensor", rng.choice(["w1", "w2"]))

    def _sleep(self, rng: random.Random) -> None:
        assert self.post("/pause_generation", {"mode": "abort"}).status_code == 200
        released = False
        for _ in range(5):
            self.post("/abort_request", {"abort_all": True})
            r = self.post("/release_memory_occupation")
            if r.status_code == 200:
                released = True
                break
            assert r.status_code == 409, r.text   # requests still queued: busy, nothing changed
            self.tally.count("release:409")
        if released:
            self.tally.count("released")
            # a tensor refit while asleep is refused: what it lent must not stay in /dev/shm
            r = self._post_tensors(rng.choice(["w1", "w2"]), "refused")
            assert r.status_code == 409, r.text
            self.tally.count("refit_refused")
            assert self.post("/resume_memory_occupation").status_code == 200
        assert self.post("/continue_generation").status_code == 200
        if released:   # weights released without a CPU backup: stale until a refit
            self._refit(rng.choice(["disk", "tensor"]), rng.choice(["w1", "w2"]))

    def _flush(self, rng: random.Random) -> None:
        assert self.post("/flush_cache").status_code in (200, 409)

    def _abort_all(self, rng: random.Random) -> None:
        assert self.post("/abort_request", {"abort_all": True}).status_code == 200

    def _checked(self, rng: random.Random) -> None:
        """miles' checked update: snapshot, compare (equal), a bracketed refit, compare again:
        equal only when the refit wrote the same checkpoint back."""
        before, target = self.weights, rng.choice(["w1", "w2"])
        assert self.post("/weights_checker", {"action": "snapshot"}).status_code == 200
        r = self.post("/weights_checker", {"action": "compare"})
        assert r.status_code == 200, r.text
        assert self.post("/begin_weight_update", {"selector": "target"}).status_code == 200
        try:
            self._refit("tensor", target)
        finally:
            assert self.post("/end_weight_update").status_code == 200
        r = self.post("/weights_checker", {"action": "compare"})
        assert r.status_code == (200 if target == before else 400), r.text

    def _profile(self, rng: random.Random) -> None:
        r = self.post("/start_profile", {"output_dir": self.traces,
                                         "num_steps": rng.randint(1, 4)})
        assert r.status_code == 200, r.text
        assert self.post("/stop_profile").status_code == 200

    def _abort_prefix(self, rng: random.Random) -> None:
        r = self.post("/abort_request", {"rid": f"c{rng.randrange(6)}-", "prefix": True,
                                         "abort_message": "chaos"})
        assert r.status_code == 200, r.text

    def _version(self, rng: random.Random) -> None:
        label = f"relabel-{rng.randrange(1000)}"
        r = self.post("/update_weight_version", {"new_version": label,
                                                 "abort_all_requests": rng.random() < 0.5})
        assert r.status_code == 200, r.text
        self.version = label


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
