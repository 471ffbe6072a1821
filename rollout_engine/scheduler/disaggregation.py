"""The scheduler's role in prefill-decode disaggregation (``--disaggregation-mode``).

A request carrying SGLang's bootstrap fields (``GenerateReq.bootstrap``) is half of a pair the
PD router sent to both servers:

- ``PrefillRole``: the request runs as usual until its first token, then ends (finish reason
  ``length``). Before its KV goes back (it stays in the radix cache for later prompts), the
  prompt's KV is gathered into a shared-memory segment and published under the room with the
  first token's records and the weights' tag. A request that ends without (aborted, refused)
  publishes the reason instead.
- ``DecodeRole``: the request waits aside (``parked``) while a worker thread fetches its room;
  then it is admitted straight into the decode batch: the prompt's KV is copied into its slots
  (past whatever prefix the radix cache already holds), the first token is appended as if
  sampled here, and the next step decodes it. KV computed under other weights than this
  server's (``WeightState.tag``) is never used: the request ends with an abort saying so.

Requests without bootstrap fields are served as by any server, in either mode.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from rollout_engine.disaggregation import kv_io
from rollout_engine.disaggregation.export import KVExporter, new_segment
from rollout_engine.disaggregation.fetch import KVFetcher, Received
from rollout_engine.disaggregation.wire import FirstToken
from rollout_engine.memory.kv_pool import KVPool
from rollout_engine.scheduler.request import Req

if TYPE_CHECKING:
    from rollout_engine.scheduler.scheduler import Scheduler

__all__ = ["NoRole", "PrefillRole", "DecodeRole", "create_role"]

# SGLang's transfer backends all mean "the engine's own transfer" here
_BACKEND_ALIASES = {"mooncake": "auto", "nixl": "auto"}


class NoRole:
    """A server outside any pair (``--disaggregation-mode null``)."""

    mode = "null"
    busy = False

    def take(self, s: Scheduler, req: Req) -> bool:
        """Whether the role holds ``req`` aside instead of queueing it."""
        return False

    def unpark(self, req: Req) -> bool:
        """An abort of a request held aside: forget it (True if it was)."""
        return False

    def after_token(self, req: Req) -> None: ...

    def before_finish(self, s: Scheduler, req: Req) -> None: ...

    def before_retire(self, req: Req) -> None: ...

    def step(self, s: Scheduler) -> None: ...

    def wait(self, timeout: float) -> None: ...

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode}

    def close(self) -> None: ...


class PrefillRole(NoRole):
    mode = "prefill"

    def __init__(self, pool: KVPool, host: str, port: int, timeout_s: float) -> None:
        self.pool = pool
        self.exporter = KVExporter(host, port, timeout_s, kv_io.layout(pool))
        self._exported: set[str] = set()   # rids whose KV was published

    def after_token(self, req: Req) -> None:
        if req.finished_reason is None:   # the decode server samples the rest
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}

    def before_finish(self, s: Scheduler, req: Req) -> None:
        if req.bootstrap is None or not req.output_ids or req.kv_len < len(req.input_ids) or \
                (req.finished_reason or {}).get("type") == "abort":
            return
        n = len(req.input_ids)
        path, buf = new_segment(kv_io.nbytes(self.pool, n))
        try:
            kv_io.gather(self.pool, req.slots[:n],
                         buf.view(self.pool.dtype).view(kv_io.shape(self.pool, n)))
        except BaseException:
            os.unlink(path)
            raise
        self.exporter.publish(req.bootstrap.room, first_token(s, req), path, buf)
        self._exported.add(req.rid)

    def before_retire(self, req: Req) -> None:
        if req.bootstrap is None:
            return
        if req.rid in self._exported:
            self._exported.discard(req.rid)
            return
        reason = req.finished_reason or {}
        self.exporter.fail(req.bootstrap.room, "the prefill server ended the request without "
                           f"KV: {reason.get('message', reason)}")

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "bootstrap_port": self.exporter.port,
                "held": self.exporter.held(), **self.exporter.stats}

    def close(self) -> None:
        self.exporter.close()


class DecodeRole(NoRole):
    mode = "decode"

    def __init__(self, pool: KVPool, backend: str, timeout_s: float) -> None:
        self.pool = pool
        self.fetcher = KVFetcher(kv_io.layout(pool), kv_io.nbytes(pool, 1),
                                 _BACKEND_ALIASES.get(backend, backend), timeout_s)
        self.parked: dict[str, Req] = {}        # fetching
        self.arrived: list[Received] = []       # fetched, waiting for room in the pool

    @property
    def busy(self) -> bool:   # type: ignore[override]
        return bool(self.parked or self.arrived)

    def take(self, s: Scheduler, req: Req) -> bool:
        b = req.bootstrap
        if b is None or req.params.max_new_tokens == 0:
            return False
        s.reqs.park(req)
        self.parked[req.rid] = req
        self.fetcher.start(req.rid, req, b.host, b.port, b.room)
        return True

    def unpark(self, req: Req) -> bool:
        if self.parked.pop(req.rid, None) is not None:
            self.fetcher.cancel(req.rid)
            return True
        for got in self.arrived:
            if got.req is req:
                self.arrived.remove(got)
                got.close()
                return True
        return False

    def step(self, s: Scheduler) -> None:
        for got in self.fetcher.ready():
            self.parked.pop(got.key, None)
            self.arrived.append(got)
        while self.arrived and s.can_run:
            if not self._admit(s, self.arrived[0]):
                return   # no room in the pool yet: in arrival order, next step
            self.arrived.pop(0)

    def wait(self, timeout: float) -> None:
        self.fetcher.wait(timeout)

    def _admit(self, s: Scheduler, got: Received) -> bool:
        """Admit a fetched request into the decode batch (False: not enough KV room now)."""
        req = got.req
        why = _refusal(s, req, got)
        if why is not None:
            got.close()
            req.finished_reason = {"type": "abort", "message": why}
            s.reqs.retire(req)
            return True
        assert got.record is not None
        resample = req.bootstrap is not None and req.bootstrap.resample
        n = len(req.input_ids) - (1 if resample else 0)
        matched = self._copy_in(s, got, n)
        if matched is None:
            return False
        if resample:
            # vLLM's protocol: the prompt's KV but its last position goes into the radix cache
            # and the request joins the queue, where admission finds it cached and computes
            # the last prompt token and the first output token here (without a radix cache,
            # or if the pool evicts it first, the prompt is recomputed: slower, never wrong)
            s.kv.release(req, cache=True)   # into the tree, under this server's weights
            s.reqs.take(req, s.namespace_of(req))
            return True
        # the prompt's logprobs are the prefill server's answer (the router merges them)
        if req.logprob_start_len >= 0:
            req.logprob_start_len = n
        s.reqs.admit(req, matched)
        append_first_token(s, req, got.record)
        if req.finished:
            s.reqs.finish(req)
            return True
        s.reqs.decoding(req)
        s.kv.cache_prefix(req)
        if req.stream:
            s.outbox.append(req.make_output(full=False))
        return True

    def _copy_in(self, s: Scheduler, got: Received, n: int) -> Optional[int]:
        """Give ``got``'s request KV slots for its first ``n`` prompt positions and copy in
        what its radix match lacks; returns the matched length, or None (no room now)."""
        req = got.req
        assert got.kv is not None
        ns = s.namespace_of(req)
        match = s.kv.match(req, ns, n)
        if not s.kv.admit(req, match, ns):
            return None
        if not s.kv.reserve(req, n):
            s.kv.release(req, cache=False)
            return None
        matched = match.matched_len
        kv = got.kv.view(self.pool.dtype).view(kv_io.shape(self.pool, len(req.input_ids)))
        kv_io.scatter(self.pool, req.slots[matched:n], kv[:, :, matched:n])
        got.close()
        req.kv_len = n
        return matched

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "parked": len(self.parked),
                "arrived": len(self.arrived), **self.fetcher.stats}

    def close(self) -> None:
        self.fetcher.close()
        for got in self.arrived:
            got.close()
        self.arrived = []


def _refusal(s: Scheduler, req: Req, got: Received) -> Optional[str]:
    if got.error is not None:
        return got.error
    assert got.record is not None
    if got.record.input_ids != req.input_ids:
        return ("the prefill server's prompt differs from this server's tokenization of it "
                "(are both serving the same model and tokenizer?)")
    if got.record.weights != s.weights.tag:
        return (f"the prefill and decode servers' weights differ: the prompt's KV was computed "
                f"under weights {got.record.weights!r} and this decode server holds "
                f"{s.weights.tag!r}; not served (refit both servers with the same calls)")
    return None


def first_token(s: Scheduler, req: Req) -> FirstToken:
    """The records of ``req``'s first output token, for the decode server."""
    def first(items: Optional[list[Any]]) -> Any:
        return items[0] if items else None

    return FirstToken(
        input_ids=list(req.input_ids), token=req.output_ids[0],
        logprob=first(req.output_logprobs), top_logprobs=first(req.output_top_logprobs),
        token_ids_logprobs=first(req.output_token_ids_logprobs),
        top_p_kept=first(req.top_p_kept),
        weight_version=req.weight_starts[0][0] if req.weight_starts else s.weights.version,
        weights=s.weights.tag)


def append_first_token(s: Scheduler, req: Req, rec: FirstToken) -> None:
    """``req``'s first output token as the prefill server sampled it, then the stop checks."""
    req.append_output(rec.token)
    req.see_weight_version(rec.weight_version)
    if req.return_logprob:
        req.output_logprobs.append(rec.logprob if rec.logprob is not None else 0.0)
        if req.top_logprobs_num and rec.top_logprobs is not None:
            req.output_top_logprobs.append(rec.top_logprobs[:req.top_logprobs_num])
        if req.token_ids_logprob is not None and rec.token_ids_logprobs is not None:
            req.output_token_ids_logprobs.append(rec.token_ids_logprobs)
    if req.top_p_kept is not None and rec.top_p_kept is not None:
        req.top_p_kept.append(rec.top_p_kept)
    req.finished_reason = s.stop_checker.check(req)


def create_role(config: Any, pool: KVPool) -> NoRole:
    mode = config.disaggregation_mode
    if mode == "prefill":
        return PrefillRole(pool, config.host, config.disaggregation_bootstrap_port,
                           config.disaggregation_transfer_timeout)
    if mode == "decode":
        return DecodeRole(pool, config.disaggregation_transfer_backend,
                          config.disaggregation_transfer_timeout)
    return NoRole()
