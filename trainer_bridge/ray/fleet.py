"""`RayRolloutFleet`: N engines as Ray actors in one placement group, driven as one.

    start_local_ray(num_cpus=2)                  # (trainer_bridge.ray.local) or ray.init(...)
    fleet = RayRolloutFleet({"model_path": path, "dtype": "float32"},
                            RayFleetConfig(num_engines=2, num_cpus_per_engine=1))
    outs = fleet.generate(input_ids=prompts, sampling_params={"n": 8, "temperature": 1.0})
    fleet.sleep(); train_step(model); fleet.wake()
    report = fleet.refit(model, version="12")    # one broadcast, every engine receives it
    [r.seconds for r in report.engines]          # each engine's refit seconds
    fleet.shutdown()

    trainer process (rank 0 of the weight-update group)      placement group, bundle i:
    RayRolloutFleet                                         EngineActor i (rank i + 1)
      dispatcher: rollout_engine.dp.dispatch (cache_aware)    rollout_engine.Engine
      RolloutFleet([RayEngine 0, ..., RayEngine N-1])         + its scheduler process

`generate` places each prompt with the data-parallel dispatcher (`load_balance_method`,
``cache_aware`` by default: the engine believed to hold the prompt's longest prefix unless the
engines' loads are imbalanced), keeps the n samples of a prompt and equal prompts of one call
on one engine, and answers in the Engine's shape (a batch prompt-major), each output's
``meta_info`` naming its ``engine_index``. Text prompts are matched on their UTF-8 bytes (the
sglang-router matches text too). Engines a failed refit quarantined get no requests.

Refit, sleep, wake and pause are `RolloutFleet`'s (trainer_bridge/fleet.py): one broadcast
for the whole fleet by default (or tensor handles / disk, engines on the trainer's host),
per-engine results, and after a failed refit no engine serving mixed weights. The fleet also
answers the Engine's RL calls (`release_memory_occupation`, `get_weight_version`, and `sync`
as `WeightSyncer` does), so a loop written for one Engine runs on the fleet unchanged.

The trainer side otherwise imports only `rollout_engine.protocol`; this module also uses the
dispatcher (pure Python) and the engine config, to reject bad flags before any actor starts.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout_engine.dp.dispatch import Load, create_dispatcher
from trainer_bridge.fleet import FleetError, FleetRefitError, FleetReport, RolloutFleet
from trainer_bridge.ray.config import RayFleetConfig
from trainer_bridge.ray.engine import WEIGHTS, WEIGHTS_THREADS, EngineActor, RayEngine
from trainer_bridge.weight_syncer import SyncReport

__all__ = ["RayRolloutFleet"]

# generate arguments that a batch may give per prompt (a list, one value each)
PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len",
              "top_logprobs_num", "extra_key", "cache_salt")


@dataclass
class _Call:
    """One engine's share of a `generate` call."""

    engine: int
    prompts: list[int]                  # indices into the caller's batch, in order
    kwargs: dict[str, Any]              # that engine's generate arguments
    load: Load = field(default_factory=Load)


@dataclass
class _Plan:
    """Where a `generate` call's prompts go: `single` (a bare prompt: the Engine's answer
    shape as it is) or a batch whose prompt i has `counts[i]` outputs (its n)."""

    single: bool
    counts: list[int]
    calls: list[_Call]

    def assemble(self, results: list[Any]) -> Any:
        for call, result in zip(self.calls, results):
            for out in result if isinstance(result, list) else [result]:
                out["meta_info"]["engine_index"] = call.engine
        if self.single:
            return results[0]
        per_prompt: list[list[Any]] = [[] for _ in self.counts]
        for call, result in zip(self.calls, results):
            outs = iter(result if isinstance(result, list) else [result])
            for i in call.prompts:
                per_prompt[i] = [next(outs) for _ in range(self.counts[i])]
        return [out for outs in per_prompt for out in outs]


class RayRolloutFleet:
    """`config.num_engines` engines built from `engine_kwargs` (Engine flags; each engine also
    gets its device and, unless given, `num_threads`) as Ray actors, one per bundle of
    `placement_group` (default: a new one of `config.bundle()` bundles, removed at shutdown;
    a shared one takes `bundle_indices`). Ray must be running (`ray.init` or
    `start_local_ray`)."""

    def __init__(self, engine_kwargs: dict[str, Any], config: Optional[RayFleetConfig] = None,
                 placement_group: Any = None, bundle_indices: Optional[list[int]] = None
                 ) -> None:
        import ray

        self.config = config = config or RayFleetConfig()
        n = config.num_engines
        if not isinstance(engine_kwargs, dict) or "model_path" not in engine_kwargs:
            raise ValueError("engine_kwargs: need a dict of Engine flags with model_path")
        from rollout_engine.config import EngineConfig
        EngineConfig.from_kwargs(**config.engine_kwargs(0, engine_kwargs))   # ValueError: field
        if bundle_indices is None:
            bundle_indices = list(range(n))
        elif len(bundle_indices) != n or not all(isinstance(b, int) for b in bundle_indices):
            raise ValueError(f"bundle_indices: need {n} bundle indices, got {bundle_indices!r}")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running: call ray.init(...) or "
                               "start_local_ray(num_cpus=...) first")
        self.own_group = placement_group is None
        if placement_group is None:
            from ray.util.placement_group import placement_group as make_group
            placement_group = make_group([config.bundle()] * n,
                                         strategy=config.placement_strategy)
        self.placement_group = placement_group
        self.actors: list[Any] = []
        try:
            self._wait_for_group()
            self.actors = [self._actor(i, b, engine_kwargs) for i, b in enumerate(bundle_indices)]
            self.infos = self._wait_for_engines()
        except BaseException:
            self._teardown()
            raise
        self.engines = [RayEngine(i, a, config.timeout_s) for i, a in enumerate(self.actors)]
        self.fleet = RolloutFleet(self.engines, transport=config.transport,
                                  bucket_bytes=config.bucket_bytes, timeout_s=config.timeout_s)
        self.dispatcher = create_dispatcher(config.load_balance_method, n)
        self.loads = [Load() for _ in range(n)]
        self.lock = threading.Lock()
        self.last_refit: Optional[FleetReport] = None
        self.closed = False

    # -- start / stop ----------------------------------------------------------------------------
    def _wait_for_group(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(self.placement_group.ready(), timeout=self.config.start_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"placement group not ready within {self.config.start_timeout_s:g} s: "
                f"{self.config.num_engines} engines of {self.config.bundle()} need more than "
                f"the cluster has free ({ray.available_resources()})") from None

    def _actor(self, index: int, bundle: int, engine_kwargs: dict[str, Any]) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.config
        options: dict[str, Any] = dict(
            num_cpus=c.num_cpus_per_engine, num_gpus=c.num_gpus_per_engine,
            max_concurrency=c.max_concurrency, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=bundle))
        if c.base_gpu_id is not None:   # every GPU visible: the engine picks its own index
            options["runtime_env"] = {"env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        actor_class = ray.remote(concurrency_groups={WEIGHTS: WEIGHTS_THREADS})(EngineActor)
        return actor_class.options(**options).remote(
            c.engine_kwargs(index, engine_kwargs))

    def _wait_for_engines(self) -> list[dict[str, Any]]:
        """Each engine's `info()` once it has started; RuntimeError naming any that failed or
        did not start within `start_timeout_s`."""
        import ray

        refs = [a.info.remote() for a in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.config.start_timeout_s)
        infos, errors = [], []
        for i, ref in enumerate(refs):
            if ref in pending:
                errors.append(f"engine {i} did not start within "
                              f"{self.config.start_timeout_s:g} s")
                continue
            try:
                infos.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - the creation task's error, named below
                errors.append(f"engine {i} did not start: {_last_line(e)}")
        if errors:
            raise RuntimeError("; ".join(errors))
        return infos

    def shutdown(self) -> None:
        """Destroy the weight-update group, stop every engine, end the actors and remove the
        placement group this fleet made. Bounded: a hung engine is killed, not waited on."""
        if not getattr(self, "closed", True):
            self.closed = True
            try:
                self.fleet.close()
            finally:
                self._teardown()

    def _teardown(self) -> None:
        import ray

        stops = [a.shutdown.remote() for a in self.actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.config.timeout_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.own_group:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)

    def __enter__(self) -> RayRolloutFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: Any = False, **kwargs: Any) -> Any:
        """`Engine.generate` over the fleet (the same arguments, `stream` excepted): each
        prompt to the engine the dispatcher picks, the engines in parallel."""
        plan = self._plan(prompt, sampling_params, input_ids, return_logprob, kwargs)
        try:
            refs = [self.engines[c.engine].submit("generate", **c.kwargs) for c in plan.calls]
            results = [self.engines[c.engine].result(ref, "generate", None)
                       for c, ref in zip(plan.calls, refs)]
        finally:
            self._finished(plan)
        return plan.assemble(results)

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: Any = False,
                             **kwargs: Any) -> Any:
        """`generate` for asyncio (many calls in flight from one event loop)."""
        plan = self._plan(prompt, sampling_params, input_ids, return_logprob, kwargs)
        try:
            refs = [self.engines[c.engine].submit("generate", **c.kwargs) for c in plan.calls]
            results = await asyncio.gather(*(self.engines[c.engine].async_result(r, "generate")
                                             for c, r in zip(plan.calls, refs)))
        finally:
            self._finished(plan)
        return plan.assemble(list(results))

    def _plan(self, prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: Any,
              kwargs: dict[str, Any]) -> _Plan:
        if kwargs.get("stream"):
            raise ValueError("stream: the Ray fleet answers whole outputs; use stream=False")
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt / input_ids: give exactly one of them")
        args = {"sampling_params": sampling_params, "return_logprob": return_logprob, **kwargs}
        field_name, given = ("prompt", prompt) if prompt is not None else ("input_ids", input_ids)
        single = isinstance(given, str) or (isinstance(given, list)
                                            and all(isinstance(t, int) for t in given))
        batch = [given] if single else given
        if not isinstance(batch, list) or not batch or not all(
                isinstance(p, str) if prompt is not None else isinstance(p, list) for p in batch):
            what = "a string" if prompt is not None else "a list of token ids"
            raise ValueError(f"{field_name}: need {what} or a non-empty list of them")
        per_prompt = {} if single else _split(args, len(batch))
        counts, chosen, calls = [], {}, {}
        with self.lock:
            for i, p in enumerate(batch):
                params = per_prompt.get("sampling_params", [sampling_params] * len(batch))[i]
                n, new_tokens = _n_and_budget(params)
                ids = list(p.encode()) if isinstance(p, str) else p
                key = tuple(ids)
                if key not in chosen:
                    chosen[key] = self._pick(ids)
                    self.dispatcher.record(ids, chosen[key])
                e = chosen[key]
                call = calls.setdefault(e, _Call(e, [], {}))
                call.prompts.append(i)
                call.load.requests += n
                call.load.tokens += n * (len(ids) + new_tokens)
                self.loads[e].requests += n
                self.loads[e].tokens += n * (len(ids) + new_tokens)
                counts.append(n)
        for call in calls.values():
            if single:
                call.kwargs = {field_name: given, **args}
            else:
                call.kwargs = {**args, field_name: [batch[i] for i in call.prompts],
                               **{k: [v[i] for i in call.prompts] for k, v in per_prompt.items()}}
        return _Plan(single, counts, list(calls.values()))

    def _pick(self, ids: list[int]) -> int:
        """The dispatcher's engine, or the least loaded serving one if that one is out
        (quarantined by a failed refit, or lost)."""
        serving = [i for i, s in enumerate(self.fleet.states)
                   if not s.quarantined and s.lost is None]
        if not serving:
            raise RuntimeError("no engine is serving: every one was quarantined or lost "
                               "(refit the fleet again, or build a new one)")
        e = self.dispatcher.pick(ids, self.loads)
        if e in serving:
            return e
        return min(serving, key=lambda i: (self.loads[i].requests, self.loads[i].tokens))

    def _finished(self, plan: _Plan) -> None:
        with self.lock:
            for c in plan.calls:
                self.loads[c.engine].requests -= c.load.requests
                self.loads[c.engine].tokens -= c.load.tokens

    # -- fleet control ---------------------------------------------------------------------------
    def sleep(self, tags: Optional[list[str]] = None) -> FleetReport:
        return self.fleet.sleep(tags)

    def wake(self, tags: Optional[list[str]] = None) -> FleetReport:
        return self.fleet.wake(tags)

    def pause(self, mode: str = "abort") -> FleetReport:
        return self.fleet.pause(mode)

    def continue_generation(self) -> FleetReport:
        return self.fleet.continue_generation()

    def weight_versions(self) -> FleetReport:
        return self.fleet.weight_versions()

    def refit(self, model_or_named_tensors: Any, version: str) -> FleetReport:
        """`RolloutFleet.refit`: one broadcast to every engine by default; the report (also
        kept as `last_refit`, failed or not) has each engine's seconds."""
        try:
            self.last_refit = self.fleet.refit(model_or_named_tensors, version)
        except FleetRefitError as e:
            self.last_refit = e.report
            raise
        return self.last_refit

    def flush_cache(self) -> bool:
        report = self.fleet.call("flush_cache", lambda e: e.flush_cache())
        return all(r.answer for r in report.engines)

    def check_integrity(self) -> list[dict[str, Any]]:
        return [r.answer for r in self.fleet.call("check_integrity",
                                                  lambda e: e.check_integrity()).engines]

    # -- the Engine's RL calls, for loops written against one Engine ----------------------------
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        engines = [r.answer for r in self.sleep(tags).engines]
        return {"bytes_freed": sum(int(a.get("bytes_freed", 0)) for a in engines),
                "engines": engines}

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict[str, Any]:
        return {"engines": [r.answer for r in self.wake(tags).engines]}

    def get_weight_version(self) -> str:
        """The version every engine serves; FleetError if they differ or some did not answer."""
        report = self.weight_versions()
        held = set(report.versions.values())
        if not report.ok or len(held) != 1 or None in held:
            raise FleetError(f"the engines do not agree on a weight version: {report.versions}",
                             report)
        return held.pop()

    def sync(self, model_or_named_tensors: Any, version: Optional[str] = None) -> SyncReport:
        """`refit` answered as `WeightSyncer.sync` (version None: one past an integer version,
        else "1"); the per-engine report is `last_refit`."""
        if version is None:
            current = self.get_weight_version()
            version = str(int(current) + 1) if current.isdigit() else "1"
        r = self.refit(model_or_named_tensors, version)
        return SyncReport(bytes=r.bytes, seconds=r.seconds,
                          gbps=r.bytes / r.seconds / 1e9 if r.seconds > 0 else 0.0,
                          version=version, num_engines=len(r.engines),
                          transport=r.transport or self.config.transport)


def _split(args: dict[str, Any], num_prompts: int) -> dict[str, list[Any]]:
    """The arguments given per prompt (a list of `num_prompts` values)."""
    out = {}
    for name in PER_PROMPT:
        value = args.get(name)
        if isinstance(value, list):
            if len(value) != num_prompts:
                raise ValueError(f"{name}: {len(value)} values for {num_prompts} prompts")
            out[name] = value
    return out


def _n_and_budget(params: Any) -> tuple[int, int]:
    """A prompt's samples (n) and new-token budget, from its sampling params."""
    get = params.get if isinstance(params, dict) else (lambda k, d=None: getattr(params, k, d))
    n = get("n", 1) or 1
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sampling_params.n: must be an int >= 1, got {n!r}")
    return n, int(get("max_new_tokens", 0) or 0)


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__
