"""KV ownership of requests: admit on a prefix match, grow by pages, cache, retract, release.

Every slot is exactly one of: free in the allocator, held by the prefix cache, or owned by one
request (its pages past ``cached_len``). All transitions live here so the invariant has one home.

A decoding request takes its slots ``DECODE_RUN`` tokens at a time (``reserve_next``) while the
pool has room to spare: with the allocator handing out pages in order, a row's own keys then lie
in runs of consecutive slots instead of one slot every batch-size slots, and the decode kernel
reads them faster (figures: docs/BENCHMARKS.md, ``benchmarks/bench_decode_layout.py``).
``ROLLOUT_ENGINE_DECODE_RUN=1`` takes one slot at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rollout_engine.env_knobs import env_int
from rollout_engine.memory.kv_pool import PageAllocator, ReqToTokenPool
from rollout_engine.memory.prefix_cache import (
    BasePrefixCache,
    CacheNamespace,
    MatchResult,
    NoPrefixCache,
)
from rollout_engine.scheduler.request import Req

DECODE_RUN_ENV = "ROLLOUT_ENGINE_DECODE_RUN"
DECODE_RUN = 16   # tokens of slots a decoding request takes at once (see the module docstring)


def decode_run_tokens() -> int:
    """``DECODE_RUN``, or ``ROLLOUT_ENGINE_DECODE_RUN`` when set (an integer >= 1)."""
    return env_int(DECODE_RUN_ENV, DECODE_RUN)


class KVManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 tree: BasePrefixCache) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree
        self.page_size = allocator.page_size
        self.caching = not isinstance(tree, NoPrefixCache)
        # pages a decoding request takes at once (1: only what the step needs)
        self.run_pages = max(1, decode_run_tokens() // self.page_size)

    def flush(self) -> None:
        """Empty the prefix cache; with no request holding KV, the allocator starts again
        from page 0 (``PageAllocator.rewind``)."""
        self.tree.reset()
        self.allocator.rewind()

    # -- capacity ----------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots that can be had now: free, or held by unlocked tree nodes (evictable)."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def pages_needed(self, req: Req, new_len: int) -> int:
        missing = new_len - len(req.slots)
        return 0 if missing <= 0 else -(-missing // self.page_size)

    # -- transitions -------------------------------------------------------------------------
    def match(self, req: Req, namespace: CacheNamespace, max_len: int) -> MatchResult:
        """Longest cached prefix of ``req``, capped at ``max_len`` tokens (page-aligned)."""
        result = self.tree.match_prefix(req.all_ids[:max_len], namespace)
        return result

    def match_for_admission(self, req: Req, namespace: CacheNamespace,
                            max_len: int) -> MatchResult:
        """``match`` over every cache tier: what lower tiers hold is loaded into device slots
        (evicting if needed) so the whole hit counts as cached; storage blocks not read yet
        leave ``req`` pending instead (``tree.prefetch_pending``). Only admission calls this."""
        return self.tree.load_back(req.all_ids[:max_len], namespace, rid=req.rid)

    def admit(self, req: Req, match: MatchResult, namespace: CacheNamespace) -> bool:
        """Give ``req`` a table row and the matched prefix (locked). False if no row is free."""
        row = self.req_to_token.allocate()
        if row is None:
            return False
        req.req_pool_idx = row
        req.namespace = namespace
        self.tree.inc_lock_ref(match.node)
        self.tree.on_admit(match)
        req.last_node = match.node
        req.slots = match.slots.tolist()
        req.cached_len = req.kv_len = len(req.slots)
        self.req_to_token.write(row, 0, req.slots)
        return True

    def reserve(self, req: Req, new_len: int) -> bool:
        """Ensure slots for positions ``[0, new_len)``, evicting cache if needed."""
        pages = self.pages_needed(req, new_len)
        if pages == 0:
            return True
        if not self.allocator.can_allocate(pages):
            short = pages * self.page_size - self.allocator.available_size()
            self.tree.evict(short)
        slots = self.allocator.allocate(pages)
        if slots is None:
            return False
        assert req.req_pool_idx is not None
        self.req_to_token.write(req.req_pool_idx, len(req.slots), slots)
        req.slots.extend(slots)
        return True

    def reserve_next(self, reqs: list[Req]) -> bool:
        """``reserve(req, req.kv_len + 1)`` for every request (a decode step), in one pass when
        the free pages cover them all without evicting; a request short of a page takes a run
        of ``run_pages`` (``decode_runs``) while the pool has room to spare. Otherwise False,
        nothing taken (reserve one by one then: exactly what each step needs)."""
        needs = [(r, self.pages_needed(r, r.kv_len + 1)) for r in reqs]
        needs = [(r, n) for r, n in needs if n]
        if not needs:
            return True
        needs = self.decode_runs(needs)
        slots = self.allocator.allocate(sum(n for _, n in needs))
        if slots is None:
            return False
        ps, taken = self.page_size, 0
        rows, starts, widths = [], [], []
        for req, n in needs:
            assert req.req_pool_idx is not None
            rows.append(req.req_pool_idx)
            starts.append(len(req.slots))
            widths.append(n * ps)
            req.slots.extend(slots[taken:taken + n * ps])
            taken += n * ps
        self.req_to_token.write_many(rows, starts, widths, slots)
        return True

    def decode_runs(self, needs: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """``needs`` (request, pages its next position needs) with each request's pages raised
        to ``run_pages``, at most what it can still fill (its last output token's KV is never
        computed); unchanged unless twice those pages are free, so runs never push a step
        into evicting or retracting."""
        if self.run_pages <= 1:
            return needs
        ps = self.page_size
        runs = []
        for req, n in needs:
            with_kv = len(req.input_ids) + req.params.max_new_tokens - 1   # positions
            usable = -(-(with_kv - len(req.slots)) // ps)
            runs.append((req, max(n, min(self.run_pages, usable))))
        total = sum(n for _, n in runs)
        free = self.allocator.available_size() // ps
        return runs if 2 * total <= free else needs

    def cache_prefix(self, req: Req) -> None:
        """Publish the computed part of ``req`` to the tree and take the tree's slots back,
        so later requests (GRPO siblings, the next chunk) can share it while ``req`` runs."""
        if not self.caching or req.kv_len <= req.cached_len:
            return
        ids = req.all_ids[:req.kv_len]
        aligned = self._insert(req, ids)
        if aligned <= req.cached_len:
            return
        result = self.tree.match_prefix(ids[:aligned], req.namespace)
        assert result.slots.numel() == aligned, "tree lost a prefix it just inserted"
        self.tree.inc_lock_ref(result.node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = result.node
        new_slots = result.slots.tolist()
        req.slots[:aligned] = new_slots
        assert req.req_pool_idx is not None
        self.req_to_token.write(req.req_pool_idx, 0, new_slots)
        req.cached_len = aligned

    def release(self, req: Req, cache: bool = True) -> None:
        """Finished or aborted: hand computed KV to the tree (or free it), free the rest."""
        if req.req_pool_idx is None:
            return
        aligned = self._insert(req, req.all_ids[:req.kv_len]) if cache else req.cached_len
        self._free_owned(req, aligned)
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.slots = None, None, []
        req.cached_len = req.kv_len = 0

    def retract(self, req: Req) -> None:
        """Out of KV in decode: drop everything ``req`` owns; it will be recomputed later."""
        self.release(req, cache=False)

    def _insert(self, req: Req, ids: list[int]) -> int:
        """Insert ``ids`` with ``req``'s slots; free ``req``'s duplicates of what the tree
        already had. Returns how many leading slots the tree now holds for ``req``."""
        aligned = len(ids) // self.page_size * self.page_size
        present = min(self.tree.insert(ids, torch.tensor(req.slots[:len(ids)]), req.namespace),
                      aligned)
        if present > req.cached_len:
            # duplicates; with the do-nothing cache (everything "present"), all of them
            self.allocator.free(req.slots[req.cached_len:present])
        return aligned

    def _free_owned(self, req: Req, start: int) -> None:
        """Free ``req.slots[start:]``, which ``req`` owns (whole pages)."""
        tail = req.slots[start:]
        if tail:
            self.allocator.free(tail)

    # -- invariant ---------------------------------------------------------------------------
    def check_integrity(self, active: Iterable[Req], idle: bool) -> dict[str, Any]:
        """Prove: free + cached + owned pages == all pages, pairwise disjoint."""
        ps = self.page_size
        self.tree.check_integrity()
        free = self.allocator.free_pages()
        cached_slots = self.tree.cached_slots().tolist()
        cached = {s // ps for s in cached_slots[::ps]}
        assert len(cached) * ps == len(cached_slots), "tree holds partial pages"
        owned: set[int] = set()
        num_active = 0
        cached_set = set(cached_slots)
        for req in active:
            num_active += 1
            assert req.req_pool_idx is not None, f"active request {req.rid} has no table row"
            assert set(req.slots[:req.cached_len]) <= cached_set, \
                f"request {req.rid} uses prefix slots the tree does not hold"
            mine = {s // ps for s in req.slots[req.cached_len:]}
            assert len(mine) * ps == len(req.slots) - req.cached_len, f"{req.rid}: partial pages"
            assert not (mine & owned), f"request {req.rid} shares pages with another request"
            owned |= mine
        assert not (free & cached), "a page is both free and cached"
        assert not (free & owned), "a page is both free and owned by a request"
        assert not (cached & owned), "a page is both cached and owned by a request"
        total = self.allocator.num_pages
        assert len(free) + len(cached) + len(owned) == total, (
            f"leak: free {len(free)} + cached {len(cached)} + owned {len(owned)} pages "
            f"!= {total}")
        assert self.req_to_token.available_size() + num_active == self.req_to_token.size, \
            "req_to_token rows leaked"
        if idle:
            assert self.tree.protected_size() == 0, "idle but tree nodes are still locked"
            assert not owned
        return {"free_tokens": len(free) * ps, "cached_tokens": len(cached) * ps,
                "owned_tokens": len(owned) * ps, "total_tokens": total * ps}
