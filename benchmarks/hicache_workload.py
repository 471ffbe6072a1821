"""What `bench_hicache.py` measures: the conversations, the tier configurations, and the two
ways of sending the conversations' turns to an engine (burst, closed loop); its docstring
describes them.

    Workload     conversations whose user messages are fixed up front (seeded)
    ClosedLoop   SGLang-style clients: Poisson sends, a cap on rounds in flight
    run_turns    turns of every conversation on an engine: wall, throughput, TTFT, tier hits
    tier_flags   the engine flags of one configuration (off, l2, l2+l3, l2_small, ...)
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

import common
import torch

VOCAB = 32000


def _rand(g: torch.Generator, length: int) -> list[int]:
    return torch.randint(5, VOCAB, (length,), generator=g).tolist()


_GAUGES = {"host_cached_tokens", "host_total_tokens", "host_pool_bytes"}


class Workload:
    """Conversations whose next user messages are fixed up front (so every configuration sees
    the same prompts once the replies agree)."""

    def __init__(self, num_convs: int, turns: int, opening: int, user: int, new: int,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.turns, self.new = turns, new
        self.openings = [_rand(g, opening) for _ in range(num_convs)]
        self.user_msgs = [[_rand(g, user) for _ in range(turns)] for _ in range(num_convs)]

    def kv_tokens_last_turn(self) -> int:
        per = len(self.openings[0]) + (self.turns - 1) * (len(self.user_msgs[0][0]) + self.new)
        return per * len(self.openings)


@dataclass(frozen=True)
class ClosedLoop:
    """SGLang-style closed-loop clients: Poisson sends at ``rate`` req/s, at most
    ``max_parallel`` in flight, a random ready round each time (``seed``)."""

    rate: float
    max_parallel: int
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.rate}")
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {self.max_parallel}")


Replies = dict[tuple[int, int], list[int]]     # (conversation, turn) -> output ids


async def _stream(engine: Any, ids: list[int], new: int) -> tuple[float, list[int]]:
    """One streamed request: (seconds from submission to the first chunk with tokens, ids)."""
    sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    submitted = time.perf_counter()
    it = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
    first: Optional[float] = None
    out: list[int] = []
    async for chunk in it:
        if first is None and chunk["output_ids"]:
            first = time.perf_counter() - submitted
        out = chunk["output_ids"]
    return (first if first is not None else float("nan")), out


async def _burst_turns(engine: Any, wl: Workload, histories: list[list[int]], turns: range
                       ) -> tuple[list[float], Replies, int]:
    """Every conversation's turn at once, turn after turn; (TTFTs, replies, prompt tokens)."""
    ttft: list[float] = []
    replies: Replies = {}
    prompt_tokens = 0
    for turn in turns:
        prompts = [h + wl.user_msgs[c][turn] for c, h in enumerate(histories)]
        prompt_tokens += sum(len(p) for p in prompts)
        res = await asyncio.gather(*(_stream(engine, p, wl.new) for p in prompts))
        for c, (t, out) in enumerate(res):
            ttft.append(t)
            replies[(c, turn)] = out
            histories[c] = prompts[c] + out
    return ttft, replies, prompt_tokens


async def _closed_loop_turns(engine: Any, wl: Workload, histories: list[list[int]],
                             turns: range, load: ClosedLoop
                             ) -> tuple[list[float], Replies, int]:
    """Each conversation a client: its next round is ready when its answer arrives; the
    sender takes a random ready round at Poisson times, at most ``max_parallel`` in flight.
    Returns (TTFTs, replies, prompt tokens)."""
    rng = random.Random(load.seed)
    ready = list(range(len(histories)))
    next_turn = [turns.start] * len(histories)
    slots = asyncio.Semaphore(load.max_parallel)   # rounds in flight
    became_ready = asyncio.Condition()
    ttft: list[float] = []
    replies: Replies = {}
    prompt_lens: list[int] = []

    async def client_round(c: int) -> None:
        turn = next_turn[c]
        prompt = histories[c] + wl.user_msgs[c][turn]
        prompt_lens.append(len(prompt))
        t, out = await _stream(engine, prompt, wl.new)
        ttft.append(t)
        replies[(c, turn)] = out
        histories[c] = prompt + out
        next_turn[c] = turn + 1
        slots.release()
        if turn + 1 < turns.stop:
            async with became_ready:
                ready.append(c)
                became_ready.notify_all()

    sent = []
    for _ in range(len(histories) * len(turns)):
        await slots.acquire()
        async with became_ready:
            await became_ready.wait_for(lambda: bool(ready))
            c = ready.pop(rng.randrange(len(ready)))
        sent.append(asyncio.create_task(client_round(c)))
        await asyncio.sleep(rng.expovariate(load.rate))     # the next Poisson arrival
    await asyncio.gather(*sent)
    return ttft, replies, sum(prompt_lens)


def run_turns(engine: Any, wl: Workload, histories: list[list[int]], turns: range,
              load: Optional[ClosedLoop] = None) -> dict[str, Any]:
    """Run ``turns`` of every conversation on ``engine`` (burst, or closed loop under
    ``load``), extending ``histories`` in place."""
    before = engine.get_server_info()
    t0 = time.perf_counter()
    if load is None:
        run = _burst_turns(engine, wl, histories, turns)
    else:
        run = _closed_loop_turns(engine, wl, histories, turns, load)
    ttft, replies, prompt_tokens = asyncio.run(run)
    wall = time.perf_counter() - t0
    gen_tokens = sum(len(o) for o in replies.values())
    after = engine.get_server_info()
    tiers_a, tiers_b = after.get("hicache") or {}, before.get("hicache") or {}
    return {
        "wall_s": wall, "requests": len(ttft), "req_s": len(ttft) / wall,
        "tok_s": (prompt_tokens + gen_tokens) / wall, "prompt_tokens": prompt_tokens,
        "ttft_p50_s": common.p50(ttft), "ttft_p99_s": common.p99(ttft),
        "prefill_tokens": after["stats"]["prefill_tokens"] - before["stats"]["prefill_tokens"],
        "cached_tokens": after["stats"]["cached_tokens"] - before["stats"]["cached_tokens"],
        "tiers": {k: v if k in _GAUGES else v - tiers_b.get(k, 0) for k, v in tiers_a.items()},
        "_replies": replies,
    }


def tier_flags(tier: str, storage_dir: Optional[str]) -> dict[str, Any]:
    """``tier``: off | l2 | l2+l3 (host tier 8x the pool: the whole working set fits) |
    l2_small | l2_small+l3 (host tier 2x the pool: half of it fits, the rest is in L3)."""
    flags: dict[str, Any] = {}
    if tier != "off":
        flags.update(enable_hierarchical_cache=True,
                     hicache_ratio=2.0 if tier.startswith("l2_small") else 8.0,
                     hicache_write_policy="write_through")
    if tier.endswith("+l3"):
        flags.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                     hicache_storage_prefetch_policy="wait_complete")
    return flags
