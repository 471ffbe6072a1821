"""The HTTP chaos test's actors: client threads, the controller, the health prober, and what
they count (``test_http_chaos.py`` runs them against a server process)."""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

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


