"""HTTP load helpers for the serving benchmarks: start and stop our server or vLLM's OpenAI
server, send a wave of requests at once, and check every answer.

A wave is all of its requests sent together (asyncio + httpx); its wall time runs from the
first send to the last complete answer body. Answers are parsed and checked after the clock
stops, so the client's JSON decoding is not timed, and a check that fails raises
``BadAnswer`` naming the request and what was wrong: a benchmark never reports the speed of
errors.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import vllm_peer  # noqa: E402

HEALTH_TIMEOUT_S = 600.0
ROUTES = ("/generate", "/v1/completions")


class BadAnswer(RuntimeError):
    """An answer that is not what the request asked for (wrong count, length, logprobs)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_env() -> dict[str, str]:
    # this checkout's engine (the server runs with cwd "/"), even if another is installed
    root = os.path.dirname(_HERE)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root] + rest)}


def server_command(side: str, model_dir: str, port: int, *, dtype: str, threads: int,
                   max_seqs: int, max_total_tokens: int, vllm_python: Optional[str] = None,
                   max_model_len: Optional[int] = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``side`` ("ours" or "vllm") on ``port``; vLLM runs
    under ``vllm_python`` (``vllm_peer.vllm_python()`` when not given), its context capped at
    ``max_model_len`` when given (a real shape's full context does not fit its KV space)."""
    if side == "ours":
        cmd = [sys.executable, "-m", "rollout_engine.launch_server", "--model-path", model_dir,
               "--port", str(port), "--dtype", dtype, "--device", "cpu",
               "--num-threads", str(threads), "--random-seed", "0",
               "--max-running-requests", str(max_seqs),
               "--max-total-tokens", str(max_total_tokens)]
        return cmd, _our_env()
    if side != "vllm":
        raise ValueError(f"side: 'ours' or 'vllm', got {side!r}")
    py = vllm_python or vllm_peer.vllm_python(setup=False)
    if py is None:
        raise RuntimeError("vLLM is not available")
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype,
           "--enable-prefix-caching", "--max-num-seqs", str(max_seqs), "--seed", "0",
           "--no-enable-log-requests"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd, vllm_peer.vllm_env(threads)


class Server:
    """A server process started by ``start``; ``stop`` ends it (a context manager too)."""

    def __init__(self, side: str, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.side, self.proc, self.url, self.log_path = side, proc, url, log_path

    @classmethod
    def start(cls, side: str, model_dir: str, log_dir: Path, **flags: Any) -> Server:
        """Start ``side`` on a free loopback port; return once ``/health`` answers 200.
        ``flags``: ``server_command``'s keywords. RuntimeError if it exits or never answers."""
        import httpx

        port = free_port()
        cmd, env = server_command(side, model_dir, port, **flags)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f".rl_http_{side}_server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/")
        server = cls(side, proc, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the {side} server exited (rc {proc.returncode}); "
                                   f"see {log_path}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.5)   # polling a process we do not control
        server.stop()
        raise RuntimeError(f"the {side} server did not become healthy within "
                           f"{HEALTH_TIMEOUT_S:.0f} s; see {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# -- request bodies ------------------------------------------------------------------------------
def generate_body(prompt: list[int], n: int, new_tokens: int) -> dict[str, Any]:
    """SGLang's native ``/generate``: token ids in, n samples, the sampled tokens' logprobs."""
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"n": n, "max_new_tokens": new_tokens, "temperature": 1.0,
                                "ignore_eos": True}}


def completions_body(model: str, prompt: list[int], n: int, new_tokens: int) -> dict[str, Any]:
    """OpenAI ``/v1/completions`` with a token-id prompt; ``logprobs: 0`` returns the sampled
    token's logprob only (both servers); ``ignore_eos`` is an extra field both take."""
    return {"model": model, "prompt": prompt, "n": n, "max_tokens": new_tokens,
            "temperature": 1.0, "logprobs": 0, "ignore_eos": True}


def body_for(route: str, model: str, prompt: list[int], n: int, new_tokens: int
             ) -> dict[str, Any]:
    if route == "/generate":
        return generate_body(prompt, n, new_tokens)
    if route == "/v1/completions":
        return completions_body(model, prompt, n, new_tokens)
    raise ValueError(f"route: one of {ROUTES}, got {route!r}")


# -- answer checks -------------------------------------------------------------------------------
def _is_logprob(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_generate(answer: Any, n: int, new_tokens: int, where: str) -> None:
    """``/generate`` with n > 1 answers a list of n dicts, each with ``new_tokens`` output ids
    and one ``[logprob, id, text]`` entry per token whose id is that token."""
    if not isinstance(answer, list) or len(answer) != n:
        raise BadAnswer(f"{where}: expected a list of {n} samples, got "
                        f"{type(answer).__name__} {str(answer)[:200]}")
    for k, sample in enumerate(answer):
        ids = sample.get("output_ids") if isinstance(sample, dict) else None
        meta = sample.get("meta_info", {}) if isinstance(sample, dict) else {}
        lps = meta.get("output_token_logprobs")
        if not isinstance(ids, list) or len(ids) != new_tokens:
            raise BadAnswer(f"{where} sample {k}: {len(ids or [])} output ids, expected "
                            f"{new_tokens} (finish_reason {meta.get('finish_reason')})")
        if not isinstance(lps, list) or len(lps) != new_tokens:
            raise BadAnswer(f"{where} sample {k}: {len(lps or [])} token logprobs, expected "
                            f"{new_tokens}")
        for j, (entry, tid) in enumerate(zip(lps, ids)):
            if not (_is_logprob(entry[0]) and entry[1] == tid):
                raise BadAnswer(f"{where} sample {k} token {j}: logprob entry {entry} for "
                                f"token {tid}")


def check_completions(answer: Any, n: int, new_tokens: int, where: str) -> None:
    """``/v1/completions`` with ``n`` and ``logprobs: 0``: n choices, each with
    ``new_tokens`` tokens and a finite logprob for every one, and usage counting them all."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise BadAnswer(f"{where}: expected {n} choices, got {str(answer)[:300]}")
    for k, choice in enumerate(choices):
        lp = choice.get("logprobs") or {}
        tokens, values = lp.get("tokens"), lp.get("token_logprobs")
        if not isinstance(tokens, list) or len(tokens) != new_tokens:
            raise BadAnswer(f"{where} choice {k}: {len(tokens or [])} tokens, expected "
                            f"{new_tokens} (finish_reason {choice.get('finish_reason')})")
        if not isinstance(values, list) or len(values) != new_tokens or not all(
                _is_logprob(v) for v in values):
            raise BadAnswer(f"{where} choice {k}: token_logprobs are not {new_tokens} finite "
                            f"logprobs: {str(values)[:200]}")
    used = (answer.get("usage") or {}).get("completion_tokens")
    if used != n * new_tokens:
        raise BadAnswer(f"{where}: usage.completion_tokens {used}, expected {n * new_tokens}")


def check_answer(route: str, answer: Any, n: int, new_tokens: int, where: str) -> None:
    (check_generate if route == "/generate" else check_completions)(answer, n, new_tokens, where)


# -- sending -------------------------------------------------------------------------------------
async def _wave(url: str, route: str, bodies: list[dict[str, Any]]) -> tuple[float, list[bytes]]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 8,
                          max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def one(body: dict[str, Any]) -> bytes:
            r = await client.post(route, json=body)
            if r.status_code != 200:
                raise BadAnswer(f"{route}: HTTP {r.status_code}: {r.text[:500]}")
            return r.content

        t0 = time.perf_counter()
        raw = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - t0, list(raw)


def send_wave(url: str, route: str, model: str, prompts: list[list[int]], n: int,
              new_tokens: int) -> float:
    """Send one request per prompt on ``route``, all at once; check every answer; return the
    wall time (first send to last answer) in seconds."""
    bodies = [body_for(route, model, p, n, new_tokens) for p in prompts]
    wall, raw = asyncio.run(_wave(url, route, bodies))
    for i, content in enumerate(raw):
        check_answer(route, json.loads(content), n, new_tokens, f"{route} request {i}")
    return wall


def model_name(url: str) -> str:
    """The id ``/v1/models`` serves first (the ``model`` an OpenAI body names)."""
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def flush_cache(url: str, timeout_s: float = 30.0) -> None:
    """Empty our server's prefix cache (every timed wave starts cold, as the offline Engine
    does); our server refuses (409) while a just-finished request still holds KV."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/flush_cache", timeout=30)
        if r.status_code == 200:
            return
        if r.status_code != 409 or time.monotonic() > deadline:
            raise RuntimeError(f"/flush_cache: HTTP {r.status_code}: {r.text[:300]}")
        time.sleep(0.05)   # polling the server's state; nothing to wait on locally

