"""A property-based state machine over one engine with a tiny KV pool (eviction, retraction and
chunked prefill on most steps), interleaving generation (random lengths, n, streaming, seeds),
aborts, sleep / wake with random tags, refits by tensor and disk with repeated version labels,
partial refits, every pause mode, continue and flush.

After every step: the scheduler is alive and ``check_integrity()`` holds. Every probe generated
while the weights are known equals a fresh engine on those weights (never stale KV, never zeroed
weights); while the weights are zeroed or half-written, generation is refused with a reason.
When an example ends, every request it started has ended with a result or a clear error.

The engine is shared by all examples (building one costs a second); each example starts by
putting it back to a known state through the public API, which is itself under test.
"""

from __future__ import annotations

import faulthandler
import os
import random
import time
from typing import Any, Optional

import psutil
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollout_engine.tokenizer_manager import EngineAsleepError, EngineBusyError
from rollout_engine.weights.loader import iter_safetensors

POOL_TOKENS = 160
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
PROBES = [[5 + i for i in range(30)], [7, 9, 11] * 6, [300, 301, 302, 303]]
LABELS = ["a", "b", "a", "v1"]          # repeated labels on purpose
TAGS = ["weights", "kv_cache", "cuda_graph"]
LOGPROB_TOL = 1e-4                      # other requests share the batch: matmul order moves
WAIT_S = 30.0                           # no request of these sizes takes a second when healthy
# A crowd: admission's estimate (a fraction of max_new_tokens) fits all of them in the pool, their
# full lengths do not (5 x 44 > POOL_TOKENS), so decode runs short and must retract.
CROWD, CROWD_PROMPT, CROWD_NEW, CROWD_ODDS = 5, 4, 40, 10


def _probe(engine: Any) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in PROBES:
        (state,), _ = engine._submit(None, GREEDY, ids, True, 0, -1, False, None, None)
        o = engine.tm.wait(state, timeout=WAIT_S)   # a hang is a failure, not a stuck CI
        out.append((o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]))
    return out


def _assert_same(got: list, want: list, where: str) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want):
        assert ids == want_ids, f"{where}: greedy tokens {ids} != fresh engine's {want_ids}"
        worst = max(abs(a - b) for a, b in zip(lps, want_lps))
        assert worst <= LOGPROB_TOL, f"{where}: logprobs off by {worst:.2e}"


class World:
    """What the examples share: the engine under test, the two checkpoints and the reference
    outputs of a fresh engine on each."""

    def __init__(self, paths: dict[str, str], engine: Any, reference: dict[str, list]) -> None:
        self.paths = paths
        self.engine = engine
        self.reference = reference
        self.tensors = {k: list(iter_safetensors(p)) for k, p in paths.items()}
        self.rss: list[tuple[float, int]] = []
        self.counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


@pytest.fixture(scope="module")
def world(make_world) -> World:
    return make_world()


@pytest.fixture(scope="module")
def make_world(tiny_paths):
    from rollout_engine import Engine
    from rollout_engine.testing.tiny_model import tiny_model_path

    paths = {"w1": tiny_paths["qwen2"], "w2": str(tiny_model_path("qwen2", seed=1))}
    reference = {}
    for key, path in paths.items():
        with Engine(model_path=path, scheduler_mode="thread", device="cpu",
                    dtype="float32") as fresh:
            reference[key] = _probe(fresh)
    engines: list[Any] = []

    def make() -> World:
        engine = Engine(model_path=paths["w1"], scheduler_mode="thread", device="cpu",
                        dtype="float32", max_total_tokens=POOL_TOKENS, chunked_prefill_size=24,
                        max_running_requests=6, random_seed=0)
        engines.append(engine)
        return World(paths, engine, reference)

    yield make
    for e in engines:
        e.shutdown()


class EngineChaos(RuleBasedStateMachine):
    world: World

    def __init__(self) -> None:
        super().__init__()
        self.e = self.world.engine
        self.pending: list[tuple[str, Any, bool]] = []   # (kind, request state, break early)
        self.rids = 0
        self.paused = False
        self.released: set[str] = set()
        self.weights: dict[str, str] = {}                # parameter name -> "w1" | "w2" | "zero"

    # -- a known start -----------------------------------------------------------------------
    @initialize()
    def reset(self) -> None:
        e = self.e
        e.continue_generation()
        e.abort_request(abort_all=True)
        e.resume_memory_occupation()
        ok, msg = e.update_weights_from_disk(self.world.paths["w1"], weight_version="start")
        assert ok, msg
        self.weights = {n: "w1" for n, _ in self.world.tensors["w1"]}
        self._wait_idle()
        assert e.flush_cache() is True

    def _wait_idle(self, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            info = self.e.get_server_info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return
            assert time.monotonic() < deadline, f"never idle: {info}"
            time.sleep(0.005)

    # -- what the engine should do now --------------------------------------------------------
    def _source(self) -> Optional[str]:
        """The checkpoint the weights equal, if they are all from one."""
        kinds = set(self.weights.values())
        return kinds.pop() if len(kinds) == 1 else None

    def _refused(self) -> bool:
        return bool(self.released & {"weights", "kv_cache"}) or "zero" in self.weights.values()

    def _sync_released(self) -> None:
        self.released = set(self.e.get_server_info()["released_memory"])

    # -- generation -----------------------------------------------------------------------------
    @rule(prompt=st.one_of(st.sampled_from(PROBES),
                           st.lists(st.integers(3, 500), min_size=1, max_size=60)),
          max_new=st.integers(0, 48), n=st.integers(1, 3), greedy=st.booleans(),
          seed=st.one_of(st.none(), st.integers(0, 2**31)), stream=st.booleans(),
          break_early=st.booleans())
    def generate(self, prompt, max_new, n, greedy, seed, stream, break_early) -> None:
        params: dict[str, Any] = {"max_new_tokens": max_new, "n": 1 if stream else n,
                                  "temperature": 0.0 if greedy else 1.0}
        if seed is not None:
            params["sampling_seed"] = seed
        self.rids += 1
        try:
            states, _ = self.e._submit(None, params, prompt, True, 0, -1, stream,
                                       f"chaos-{self.rids}", None)
        except EngineAsleepError as err:
            assert self._refused(), f"refused while awake with good weights: {err}"
            return
        assert not self._refused(), "a request was accepted while asleep or stale"
        self.pending.extend(("stream" if stream else "plain", s, break_early) for s in states)

    @rule()
    def generate_bigger_than_the_pool(self) -> None:
        with pytest.raises((ValueError, EngineAsleepError), match="pool|asleep|stale"):
            self.e._submit(None, {"max_new_tokens": 4}, list(range(5, 5 + POOL_TOKENS + 8)),
                           False, 0, -1, False, None, None)

    @precondition(lambda self: not self.paused)
    @rule(go=st.integers(0, CROWD_ODDS - 1))
    def crowd_the_pool(self, go: int) -> None:
        """Queued together behind an in-place pause, then let in at once: retraction, whatever
        the machine's speed. One draw in ``CROWD_ODDS`` (each costs some forty decode steps);
        drawn, not counted across examples, so an example replays the same."""
        if go or self._refused():
            return
        self.world.count("crowd")
        self.e.pause_generation("in_place")
        params = {"max_new_tokens": CROWD_NEW, "temperature": 0.0, "ignore_eos": True}
        for i in range(CROWD):
            self.rids += 1
            prompt = [400 + 10 * i + j for j in range(CROWD_PROMPT)]
            states, _ = self.e._submit(None, params, prompt, True, 0, -1, False,
                                       f"chaos-{self.rids}", None)
            self.pending.extend(("plain", s, False) for s in states)
        self.e.continue_generation()

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def abort_one(self, data) -> None:
        _, state, _ = data.draw(st.sampled_from(self.pending))
        self.e.abort_request(state.req.rid)

    # -- sleep / wake ------------------------------------------------------------------------------
    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(TAGS), unique=True, min_size=1)))
    def release(self, tags) -> None:
        try:
            self.e.release_memory_occupation(tags)
        except EngineBusyError:
            pass  # requests hold KV or wait: refused, nothing changed
        self._sync_released()

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(TAGS), unique=True, min_size=1)))
    def resume(self, tags) -> None:
        wanted = set(TAGS if tags is None else tags)
        if "weights" in wanted & self.released:
            self.weights = {n: "zero" for n in self.weights}   # no CPU backup
        self.e.resume_memory_occupation(tags)
        self._sync_released()

    # -- refit -------------------------------------------------------------------------------------
    @rule(source=st.sampled_from(["w1", "w2"]), how=st.sampled_from(["disk", "tensor"]),
          label=st.one_of(st.none(), st.sampled_from(LABELS)), flush=st.booleans())
    def refit(self, source, how, label, flush) -> None:
        if how == "disk":
            ok, msg = self.e.update_weights_from_disk(self.world.paths[source],
                                                      weight_version=label, flush_cache=flush)
        else:
            ok, msg = self.e.update_weights_from_tensor(self.world.tensors[source],
                                                        weight_version=label, flush_cache=flush)
        if "weights" in self.released:
            assert not ok and "released" in msg
            return
        assert ok, msg
        self.weights = {n: source for n in self.weights}
        self.probe()

    @rule(source=st.sampled_from(["w1", "w2"]), data=st.data())
    def partial_refit(self, source, data) -> None:
        tensors = self.world.tensors[source]
        k = data.draw(st.integers(1, len(tensors) - 1))
        chosen = random.Random(data.draw(st.integers(0, 1000))).sample(tensors, k)
        ok, msg = self.e.update_weights_from_tensor(chosen, flush_cache=False,
                                                    weight_version="step.partial")
        if "weights" in self.released:
            assert not ok
            return
        assert ok, msg
        for name, _ in chosen:
            self.weights[name] = source   # the others stay as they were (maybe zeroed)
        self.probe()

    # -- pause / continue / flush ------------------------------------------------------------------
    @rule(mode=st.sampled_from(["abort", "retract", "in_place"]))
    def pause(self, mode) -> None:
        self.e.pause_generation(mode)
        self.paused = True

    @rule()
    def continue_generation(self) -> None:
        self.e.continue_generation()
        self.paused = False

    @rule()
    def flush(self) -> None:
        self.e.flush_cache()   # True when idle, False (409) while busy: both are fine

    # -- checks ------------------------------------------------------------------------------------
    @rule()
    def probe(self) -> None:
        """Greedy probes: a fresh engine's outputs when the weights are known, refusal when
        they are zeroed or half-written, queued behind a pause otherwise (not run)."""
        if self.paused:
            return
        if self._refused():
            with pytest.raises(EngineAsleepError):
                self.e._submit(None, GREEDY, PROBES[0], False, 0, -1, False, None, None)
            self.world.count("probe_refused")
            return
        source = self._source()
        if source is None:
            return  # a mix of two checkpoints: no reference to compare with
        _assert_same(_probe(self.e), self.world.reference[source], f"weights {source}")
        self.world.count(f"probe_{source}")

    @invariant()
    def alive_and_consistent(self) -> None:
        assert self.e.tm.dead is None, self.e.tm.dead
        self.e.check_integrity()

    def teardown(self) -> None:
        """Every request ends: with a result, or an abort saying why."""
        if self.e.tm.dead is not None:
            return
        self.e.continue_generation()
        for kind, state, break_early in self.pending:
            chunks = self.e.tm.iter_chunks(state) if kind == "stream" else None
            if chunks is not None and break_early:
                chunks.close()   # leaving a stream early aborts the request
            out = self.e.tm.wait(state, timeout=WAIT_S)
            if chunks is not None and not break_early:
                assert all("output_ids" in c for c in chunks)   # ends: the request is done
            reason = out["meta_info"]["finish_reason"]
            self.world.count(f"finished_{reason['type']}")
            assert reason["type"] in ("stop", "length", "abort"), reason
            if reason["type"] == "abort":
                assert reason.get("message"), reason
            elif reason["type"] == "length":
                assert len(out["output_ids"]) == state.req.sampling_params.max_new_tokens
        self._wait_idle()
        self.e.check_integrity()
        self.world.rss.append((time.time(), psutil.Process(os.getpid()).memory_info().rss))


def _run(world: World, max_examples: int, derandomize: bool) -> None:
    EngineChaos.world = world
    machine = EngineChaos.TestCase
    machine.settings = settings(max_examples=max_examples, stateful_step_count=25,
                                deadline=None, derandomize=derandomize, database=None,
                                suppress_health_check=list(HealthCheck),
                                phases=[Phase.explicit, Phase.generate] if os.environ.get('CHAOS_NO_SHRINK') else list(Phase))
    # a deadlock must fail with the threads' stacks, not hold CI until its own timeout
    faulthandler.dump_traceback_later(600, exit=True)
    try:
        machine("runTest").runTest()
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_engine_state_machine(world: World) -> None:
    start = time.monotonic()
    _run(world, max_examples=200, derandomize=True)
    assert len(world.rss) >= 200
    stats = world.engine.get_server_info()["stats"]
    print(f"\nchaos: {world.counts}; engine stats {stats}")
    # the examples reached the states they are meant to test
    for what in ("probe_w1", "probe_w2", "probe_refused", "finished_length", "finished_abort",
                 "crowd"):
        assert world.counts.get(what, 0) >= 5, (what, world.counts)
    assert stats["num_retractions"] > 0
    assert time.monotonic() - start < 180


@pytest.mark.slow
def test_chaos_soak(world: World) -> None:
    """Thousands of random examples; RSS must not grow without bound (printed for docs/BENCHMARKS.md)."""
    torch.manual_seed(0)
    start = time.monotonic()
    _run(world, max_examples=2000, derandomize=False)
    rss = [r for _, r in world.rss]
    first, last = rss[len(rss) // 10], rss[-1]
    print(f"\nchaos soak: {len(rss)} examples in {time.monotonic() - start:.0f} s; RSS "
          f"{first / 2**20:.0f} MiB after 10% -> {last / 2**20:.0f} MiB at the end, "
          f"max {max(rss) / 2**20:.0f} MiB")
    assert last - first < 200 * 2**20

