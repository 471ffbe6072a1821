"""HTTP clients for a rollout server: every route of docs/API.md, sync and async.

`RolloutClient` and `AsyncRolloutClient` share one definition of each route (`_Routes`); they
differ only in how a request is sent. Method names and return values follow the Python
`Engine`, so anything that drives an Engine (a `WeightSyncer`, `engine_sleeping`) drives a
server through a client too:

    client = RolloutClient("http://127.0.0.1:30000")
    client.wait_healthy(60)
    rollouts = client.generate_batch(["2 + 2 ="], {"temperature": 1.0, "max_new_tokens": 32}, n=8)
    ok, message = client.update_weights_from_tensor(model.named_parameters(), weight_version="7")

Every non-2xx answer raises `RolloutError(status, message)` (the server's
`{"error": {"message": ...}}`); updates return `(success, message)` as the Engine does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from rollout_engine.protocol.payload_sender import lend_named_tensors
from rollout_engine.protocol.shm_lease import ShmLease
from trainer_bridge.client_lora import LoraRoutes

__all__ = ["AsyncRolloutClient", "Rollout", "RolloutClient", "RolloutError", "to_rollouts"]

DEFAULT_TIMEOUT = 600.0  # a refit or a long batch can take minutes; connect errors come fast


class RolloutError(RuntimeError):
    """A route answered with an error status (400 bad input, 401 bad key, 409 busy, 503 asleep
    or unhealthy, 5xx failure); `message` is the server's explanation."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Rollout:
    """One sampled completion: what a policy-gradient step needs from it."""

    prompt_index: int
    sample_index: int
    output_ids: list[int]
    output_logprobs: list[float]       # log p(token) under the weights that sampled it
    weight_versions: list[str]         # the label(s) that sampled the tokens, in order
    finish_reason: Optional[dict[str, Any]]
    text: str

    @property
    def weight_version(self) -> Optional[str]:
        return self.weight_versions[-1] if self.weight_versions else None


def to_rollouts(outputs: Any, n: int) -> list[Rollout]:
    """Turn `/generate` (or `Engine.generate`) output for a batch sampled `n` times per prompt
    into `Rollout`s; outputs come prompt-major: prompt 0's n samples, then prompt 1's, ..."""
    outputs = outputs if isinstance(outputs, list) else [outputs]
    rollouts = []
    for k, out in enumerate(outputs):
        meta = out["meta_info"]
        # the engine's spans ({"version", "start", "end"}); a bare label list is read too
        spans = meta.get("weight_versions") or []
        versions = [s["version"] if isinstance(s, dict) else s for s in spans] or (
            [meta["weight_version"]] if meta.get("weight_version") is not None else [])
        rollouts.append(Rollout(
            prompt_index=k // n, sample_index=k % n, output_ids=list(out["output_ids"]),
            output_logprobs=[lp for lp, *_ in meta.get("output_token_logprobs", [])],
            weight_versions=list(versions), finish_reason=meta.get("finish_reason"),
            text=out.get("text", "")))
    return rollouts


def _json(response: httpx.Response) -> Any:
    return response.json()


def _result(response: httpx.Response) -> Any:
    """A control route's payload: the `result` of `{"success", "message", "result"}`, or the
    whole body for routes that answer it bare."""
    body = response.json()
    if isinstance(body, dict) and "success" in body and "result" in body:
        return body["result"]
    return body


def _update_result(response: httpx.Response) -> tuple[bool, str]:
    body = response.json()
    return bool(body.get("success", True)), str(body.get("message", ""))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class _Routes(LoraRoutes):
    """Each route once (the LoRA routes in client_lora.py). `_send` returns the parsed answer (sync) or an awaitable of it
    (async); the error check happens before `parse`, unless the status is in `accept`."""

    def __init__(self, base_url: str, api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def _send(self, method: str, path: str, body: Optional[dict[str, Any]] = None, *,
              admin: bool = False, parse: Callable[[httpx.Response], Any] = _json,
              accept: Sequence[int] = ()) -> Any:
        raise NotImplementedError

    def _holding(self, lease: ShmLease, send: Callable[[], Any]) -> Any:
        """`send()`, `lease` released once it answered or failed (sync: here; async: when the
        returned coroutine finishes)."""
        raise NotImplementedError

    def _headers(self, admin: bool) -> dict[str, str]:
        # the server's admin key also passes its user-key check
        key = (self.admin_api_key if admin and self.admin_api_key
               else self.api_key or self.admin_api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    @staticmethod
    def _finish(response: httpx.Response, parse: Callable[[httpx.Response], Any],
                accept: Sequence[int]) -> Any:
        if response.status_code >= 400 and response.status_code not in accept:
            raise RolloutError(response.status_code, _error_message(response))
        return parse(response)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: Any = False, top_logprobs_num: Any = 0,
                 logprob_start_len: Any = -1, rid: Any = None,
                 return_routed_experts: Any = False, routed_experts_start_len: Any = 0,
                 lora_path: Any = None) -> Any:
        """POST /generate (non-streaming): a dict, or a list for a batch or n > 1. A MoE
        server started with ``--enable-return-routed-experts`` returns
        ``meta_info["routed_experts"]`` where ``return_routed_experts`` asks. ``lora_path``:
        a loaded adapter's name (a list: one per prompt; None: the base model)."""
        body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
                "return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                "logprob_start_len": logprob_start_len, "rid": rid, "lora_path": lora_path}
        if return_routed_experts:   # absent otherwise: a server without the field accepts it
            body.update(return_routed_experts=return_routed_experts,
                        routed_experts_start_len=routed_experts_start_len)
        return self._send("POST", "/generate", _drop_none(body))

    def generate_batch(self, prompts_or_ids: list[Any], sampling_params: Optional[dict] = None,
                       n: int = 1, lora_path: Any = None) -> Any:
        """Sample `n` completions of each prompt (strings or token-id lists) with logprobs,
        with the adapter `lora_path` when given; returns `Rollout`s, prompt-major."""
        if not isinstance(prompts_or_ids, list) or not prompts_or_ids:
            raise ValueError("prompts_or_ids: must be a non-empty list of strings or id lists")
        params = {**(sampling_params or {}), "n": n}
        key = "text" if isinstance(prompts_or_ids[0], str) else "input_ids"
        return self._send("POST", "/generate", _drop_none({
            key: prompts_or_ids, "sampling_params": params, "return_logprob": True,
            "lora_path": lora_path}), parse=lambda r: to_rollouts(r.json(), n))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> Any:
        return self._send("POST", "/abort_request", {"rid": rid, "abort_all": abort_all},
                          admin=abort_all, parse=lambda r: None)

    # -- introspection ---------------------------------------------------------------------------
    def health(self) -> Any:
        """True on 200, False on 503 (asleep or unhealthy)."""
        return self._send("GET", "/health", parse=lambda r: r.status_code == 200, accept=(503,))

    def health_generate(self) -> Any:
        return self._send("GET", "/health_generate", parse=lambda r: r.status_code == 200,
                          accept=(503,))

    def get_model_info(self) -> Any:
        return self._send("GET", "/get_model_info")

    def get_server_info(self) -> Any:
        return self._send("GET", "/get_server_info")

    def get_weight_version(self) -> Any:
        return self._send("GET", "/get_weight_version", parse=lambda r: _result(r)["weight_version"])

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> Any:
        """Relabel the weights (their KV stays valid); aborts running requests unless
        ``abort_all_requests=False``, as the Engine's."""
        body: dict[str, Any] = {"new_version": new_version}
        if not abort_all_requests:   # the route's default is True
            body["abort_all_requests"] = False
        return self._send("POST", "/update_weight_version", body, admin=True,
                          parse=lambda r: _result(r)["weight_version"])

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self._send("POST", "/get_weights_by_name",
                          {"name": name, "truncate_size": truncate_size}, admin=True,
                          parse=_result)

    def metrics(self) -> Any:
        """Prometheus text."""
        return self._send("GET", "/metrics", parse=lambda r: r.text)

    # -- control ---------------------------------------------------------------------------------
    def flush_cache(self) -> Any:
        """True once flushed; raises RolloutError(409) while requests are in flight."""
        return self._send("POST", "/flush_cache", admin=True, parse=lambda r: True)

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._send("POST", "/pause_generation", {"mode": mode}, admin=True, parse=_result)

    def continue_generation(self) -> Any:
        return self._send("POST", "/continue_generation", {}, admin=True, parse=_result)

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> Any:
        return self._send("POST", "/release_memory_occupation", _drop_none({"tags": tags}),
                          admin=True, parse=_result)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> Any:
        return self._send("POST", "/resume_memory_occupation", _drop_none({"tags": tags}),
                          admin=True, parse=_result)

    # -- weights ---------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> Any:
        return self._send("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": load_format,
            "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests}, admin=True, parse=_update_result)

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Optional[str] = None,
                                   flush_cache: bool = True,
                                   weight_version: Optional[str] = None) -> Any:
        """`named_tensors`: (name, tensor) pairs, FlattenedBucket(s) with
        `load_format="flattened_bucket"`, or already-serialized payload strings (one per TP
        rank). Tensors travel as shared-memory / CUDA IPC handles, so the server must run on
        this host; keep them unmodified until this returns. Their shared memory is lent
        (`shm_lease`) for the request and let go once it is answered, refused or failed."""
        lease = ShmLease()
        if isinstance(named_tensors, list) and named_tensors and isinstance(named_tensors[0], str):
            serialized = named_tensors
        else:
            if not isinstance(named_tensors, (list, tuple, dict)) and not hasattr(
                    named_tensors, "named_tensors"):
                named_tensors = list(named_tensors)  # generators do not pickle
            text, lease = lend_named_tensors(named_tensors)
            serialized = [text]
        return self._holding(lease, lambda: self._send("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version},
            admin=True, parse=_update_result))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> Any:
        """Blocks until every rank (the trainer included) has joined the group."""
        return self._send("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, admin=True, parse=_update_result)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        load_format: Optional[str] = None,
                                        flush_cache: bool = True,
                                        weight_version: Optional[str] = None) -> Any:
        """Blocks until the trainer's broadcast of these tensors has been received."""
        return self._send("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
            "load_format": load_format, "flush_cache": flush_cache,
            "weight_version": weight_version}, admin=True, parse=_update_result)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        return self._send("POST", "/destroy_weights_update_group", {"group_name": group_name},
                          admin=True, parse=_update_result)


class RolloutClient(_Routes):
    """Blocking client (one `httpx.Client`, safe to share between threads)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: Optional[httpx.BaseTransport] = None) -> None:
        super().__init__(base_url, api_key, admin_api_key)
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def _send(self, method: str, path: str, body: Optional[dict[str, Any]] = None, *,
              admin: bool = False, parse: Callable[[httpx.Response], Any] = _json,
              accept: Sequence[int] = ()) -> Any:
        response = self.http.request(method, path, json=body, headers=self._headers(admin))
        return self._finish(response, parse, accept)

    def _holding(self, lease: ShmLease, send: Callable[[], Any]) -> Any:
        try:
            return send()
        finally:
            lease.release()

    def wait_healthy(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        """Poll /health until it answers 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last: object = "no answer"
        while time.monotonic() < deadline:
            try:
                if self.health():
                    return
                last = "503"
            except (httpx.TransportError, RolloutError) as e:
                last = e
            time.sleep(interval)
        raise TimeoutError(f"{self.base_url} not healthy after {timeout:.0f}s (last: {last})")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncRolloutClient(_Routes):
    """The same routes as coroutines (`await client.generate(...)`), on one
    `httpx.AsyncClient`."""

    def __init__(self, base_url: str, api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        super().__init__(base_url, api_key, admin_api_key)
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                      transport=transport)

    async def _send(self, method: str, path: str, body: Optional[dict[str, Any]] = None, *,
                    admin: bool = False, parse: Callable[[httpx.Response], Any] = _json,
                    accept: Sequence[int] = ()) -> Any:
        response = await self.http.request(method, path, json=body,
                                           headers=self._headers(admin))
        return self._finish(response, parse, accept)

    async def _holding(self, lease: ShmLease, send: Callable[[], Any]) -> Any:
        try:
            return await send()
        finally:
            lease.release()

    async def wait_healthy(self, timeout: float = 60.0, interval: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        last: object = "no answer"
        while time.monotonic() < deadline:
            try:
                if await self.health():
                    return
                last = "503"
            except (httpx.TransportError, RolloutError) as e:
                last = e
            await asyncio.sleep(interval)
        raise TimeoutError(f"{self.base_url} not healthy after {timeout:.0f}s (last: {last})")

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
