"""`RolloutFleet`: one trainer driving N rollout engines together (refit, sleep, wake, pause).

    fleet = RolloutFleet([engine_a, client_b], transport="distributed")  # one group, 1 + N ranks
    report = fleet.refit(model, version="step-12")   # each tensor broadcast once to every engine
    fleet.sleep(); train_step(model); fleet.wake()  # all engines at once, a thread each
    fleet.close()

Engines are in-process `Engine`s or `RolloutClient`s, as for `WeightSyncer` (which the fleet
uses for the refit itself). With the "distributed" transport the trainer is rank 0 and engine
i rank i + 1 of one weight-update group, so the trainer's send cost does not grow with N.

A refit that fails on some engines never leaves the fleet serving two weight versions
silently. The fleet asks every engine its version (with a timeout) and keeps serving the
*target* version if any engine reached it, else the version it served before. Every reachable
engine on another version (the old one, or a half-applied ``<v>.partialK``) is *quarantined*:
generation paused (in-flight requests aborted) and its weights released, so it answers 503
"asleep" instead of sampling from stale or mixed weights. That is cheap (no rollback refit,
which would need the old weights the trainer no longer has) and honest: `FleetRefitError`
lists which engine holds which version, and which are quarantined or unreachable. The next
`refit` wakes the quarantined engines first and re-forms the group over the reachable ones;
an engine that died stays out (`lost`) until the caller builds a new fleet.

The servers of a prefill-decode pair (``disaggregation_mode`` prefill / decode, behind a PD
router) are members like any other; pause, sleep and relabel reach the prefill servers first,
wake and continue the decode servers first, and a refit gives both the same calls
(`trainer_bridge.pd_order`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional

from trainer_bridge.fleet_report import (
    EngineResult,
    FleetError,
    FleetRefitError,
    FleetReport,
)
from trainer_bridge.pd_order import DOWN, UP, phases, role_of
from trainer_bridge.timed_engine import TimedEngine
from trainer_bridge.transports.base import WeightTransport, spawn
from trainer_bridge.transports.disk import DiskTransport
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport
from trainer_bridge.weight_syncer import DEFAULT_BUCKET_BYTES, TRANSPORTS, WeightSyncer

__all__ = ["EngineResult", "FleetError", "FleetRefitError", "FleetReport", "RolloutFleet"]


@dataclass
class _State:
    """What the fleet knows of one engine between calls."""

    quarantined: bool = False
    lost: Optional[str] = None     # why the engine is out of the fleet (it stopped answering)
    role: Optional[str] = None     # its disaggregation mode, once it answered (pd_order.py)
    seconds: dict[str, float] = field(default_factory=dict)


def _transport(name: str, bucket_bytes: Optional[int], master_address: str,
               master_port: Optional[int], backend: str, timeout_s: float) -> WeightTransport:
    """The transport named `name`, bounded by `timeout_s` per engine call."""
    if name == "distributed":
        return DistributedTransport(master_address, master_port, backend, bucket_bytes,
                                    timeout_s=timeout_s)
    if name == "tensor":
        return TensorTransport(bucket_bytes, timeout_s=timeout_s)
    if name == "disk":
        return DiskTransport(timeout_s=timeout_s)
    raise ValueError(f"transport: must be one of {TRANSPORTS}, got {name!r}")


class RolloutFleet:
    """N engines driven as one. `timeout_s` bounds every engine call (a refit's group
    formation and each of its calls; sleep, wake, pause, version queries), so a dead or hung
    engine is reported, never waited on forever."""

    def __init__(self, engines: Sequence[Any], transport: str = "distributed",
                 bucket_bytes: Optional[int] = DEFAULT_BUCKET_BYTES,
                 master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 backend: str = "gloo", timeout_s: float = 60.0) -> None:
        if not isinstance(engines, (list, tuple)) or not engines:
            raise ValueError("engines: need a non-empty list of Engines / RolloutClients")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s: must be a positive number, got {timeout_s!r}")
        self.engines = list(engines)
        self.states = [_State() for _ in self.engines]
        self.transport_name = transport
        self.timeout_s = float(timeout_s)
        self._make_transport: Callable[[], WeightTransport] = lambda: _transport(
            transport, bucket_bytes, master_address, master_port, backend, self.timeout_s)
        self.syncer: Optional[WeightSyncer] = None
        self.members: list[int] = []     # the engines the current syncer (group) was made for
        self.timed: list[TimedEngine] = []   # those engines, as the syncer calls them
        self.version: Optional[str] = None   # the version the fleet serves (None: not refitted)
        self.closed = False

    # -- fan-out ---------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.lost is None]

    def _fan_out(self, action: str, call: Callable[[Any], Any],
                 indices: Optional[list[int]] = None) -> list[EngineResult]:
        """`call(engine)` for each engine in `indices` (default: every live one) in parallel
        threads, each bounded by `timeout_s`; an engine that does not answer in time is
        reported as failed (its thread is a daemon and is left behind)."""
        indices = self._live() if indices is None else indices
        starts: dict[int, float] = {}
        futures: dict[int, Future[Any]] = {}
        for i in indices:
            starts[i] = time.perf_counter()
            futures[i] = spawn(call, self.engines[i])
        wait(list(futures.values()), timeout=self.timeout_s)
        results = []
        for i in indices:
            f = futures[i]
            elapsed = time.perf_counter() - starts[i]
            if not f.done():
                results.append(EngineResult(i, False, elapsed, error=(
                    f"engine {i}: {action} did not answer within {self.timeout_s:g} s")))
            elif f.exception() is not None:
                results.append(EngineResult(i, False, elapsed,
                                            error=f"engine {i}: {action}: {f.exception()}"))
            else:
                results.append(EngineResult(i, True, elapsed, answer=f.result()))
        return results

    def _fan_out_ordered(self, action: str, call: Callable[[Any], Any],
                         direction: Optional[str]) -> list[EngineResult]:
        """`_fan_out` over the live engines, in the phases of `direction` (pd_order.py: the
        prefill servers of PD pairs first going DOWN, last coming UP); None: all at once."""
        if direction is None:
            return self._fan_out(action, call)
        live = self._live()
        unknown = [i for i in live if self.states[i].role is None]
        if unknown:
            for r in self._fan_out("get_server_info", role_of, unknown):
                if r.ok:
                    self.states[r.index].role = r.answer
        # an engine whose role is not known yet (it did not answer) goes with the decode side
        roles = {i: self.states[i].role or "null" for i in live}
        results = [r for phase in phases(roles, direction)
                   for r in self._fan_out(action, call, phase)]
        return sorted(results, key=lambda r: r.index)

    def call(self, action: str, call: Callable[[Any], Any]) -> FleetReport:
        """`call(engine)` on every live engine at once (a thread each, bounded by `timeout_s`),
        e.g. ``fleet.call("flush", lambda e: e.flush_cache())``; raises FleetError naming the
        engines that failed, with every engine's answer in its report."""
        return self._checked(action, call)

    def _checked(self, action: str, call: Callable[[Any], Any],
                 direction: Optional[str] = None) -> FleetReport:
        self._check_open()
        start = time.perf_counter()
        results = self._fan_out_ordered(action, call, direction)
        report = FleetReport(action, time.perf_counter() - start, results)
        if not report.ok:
            raise FleetError("; ".join(r.error for r in results if r.error), report)
        return report

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RolloutFleet is closed")

    # -- sleep / wake / pause --------------------------------------------------------------------
    def sleep(self, tags: Optional[list[str]] = None) -> FleetReport:
        """Release every engine's memory (`tags` as `release_memory_occupation`; engines must
        be idle or paused); prefill servers first. Raises FleetError naming the engines that
        refused."""
        return self._checked("sleep", lambda e: e.release_memory_occupation(tags), DOWN)

    def wake(self, tags: Optional[list[str]] = None) -> FleetReport:
        """Resume every engine's memory (after releasing weights without a CPU backup the
        engines refuse generation until the next `refit`); decode servers first."""
        return self._checked("wake", lambda e: e.resume_memory_occupation(tags), UP)

    def pause(self, mode: str = "abort") -> FleetReport:
        """`pause_generation(mode)` on every engine (abort, retract or in_place); prefill
        servers first."""
        return self._checked("pause", lambda e: e.pause_generation(mode), DOWN)

    def continue_generation(self) -> FleetReport:
        """`continue_generation` on every engine; decode servers first."""
        return self._checked("continue", lambda e: e.continue_generation(), UP)

    def update_weight_version(self, new_version: str,
                              abort_all_requests: bool = True) -> FleetReport:
        """Relabel every engine's weights `new_version` (the label is part of the weight tag
        both servers of a PD pair must agree on); prefill servers first."""
        if not isinstance(new_version, str) or not new_version:
            raise ValueError(f"new_version: must be a non-empty string, got {new_version!r}")
        report = self._checked("update_weight_version", lambda e: e.update_weight_version(
            new_version, abort_all_requests=abort_all_requests), DOWN)
        self.version = new_version
        return report

    def weight_versions(self) -> FleetReport:
        """Every live engine's weight version (`report.versions`); failures are reported, not
        raised."""
        self._check_open()
        start = time.perf_counter()
        results = [_with_version(r) for r in
                   self._fan_out("get_weight_version", lambda e: e.get_weight_version())]
        return FleetReport("weight_versions", time.perf_counter() - start, results)

    # -- refit -----------------------------------------------------------------------------------
    def refit(self, model_or_named_tensors: Any, version: str) -> FleetReport:
        """Load the weights (a module, a state dict or (name, tensor) pairs) into every live
        engine, labelled `version`: one broadcast for the "distributed" transport. Raises
        FleetRefitError, with every engine's version, when some engine did not end on
        `version` (see the module docstring for what the fleet does to it)."""
        self._check_open()
        if not isinstance(version, str) or not version:
            raise ValueError(f"version: must be a non-empty string, got {version!r}")
        start = time.perf_counter()
        self._wake_quarantined()
        if self.version is None:
            self.version = self._agreed_version()
        error: Optional[BaseException] = None
        moved = 0
        push_start = start
        try:
            syncer = self._syncer()
            push_start = time.perf_counter()
            moved = syncer.sync(model_or_named_tensors, version).bytes
        except Exception as e:  # noqa: BLE001 - reported per engine below
            error = e
        seconds = time.perf_counter() - start
        if error is None:
            self.version = version
            results = [EngineResult(i, True, t.seconds_since(push_start, seconds),
                                    version=version) for i, t in zip(self.members, self.timed)]
            return self._refit_report(results, seconds, moved, version)
        return self._after_failed_refit(error, seconds, version)

    def _agreed_version(self) -> Optional[str]:
        """The version every live engine reports before the fleet's first refit, if they
        agree (what a failed first refit falls back to serving); else None."""
        held = {r.version for r in self.weight_versions().engines}
        return held.pop() if len(held) == 1 else None

    def _syncer(self) -> WeightSyncer:
        """The syncer over the live engines (a new group after a failure or a lost engine)."""
        live = self._live()
        if not live:
            raise FleetRefitError("no engine is left in the fleet", FleetReport("refit", 0, []))
        if self.syncer is None or self.members != live:
            self._drop_syncer()
            timed = [TimedEngine(self.engines[i]) for i in live]
            self.syncer = WeightSyncer(timed, transport=self._make_transport())
            self.members, self.timed = live, timed
        return self.syncer

    def _drop_syncer(self) -> None:
        """Tear the syncer down (destroying the group on the engines that still answer)."""
        syncer, self.syncer, self.members, self.timed = self.syncer, None, [], []
        if syncer is None:
            return
        try:
            _bounded(syncer.close, self.timeout_s)
        except Exception:  # noqa: BLE001 - a dead engine cannot destroy its side
            pass

    def _wake_quarantined(self) -> None:
        """Resume the weights of the engines a failed refit left asleep, so they receive this
        refit (with no CPU backup they refuse generation until it lands), and let them serve."""
        indices = [i for i in self._live() if self.states[i].quarantined]
        if not indices:
            return

        def wake(engine: Any) -> None:
            engine.resume_memory_occupation(["weights"])
            engine.continue_generation()
        for r in self._fan_out("wake a quarantined engine", wake, indices):
            if r.ok:
                self.states[r.index].quarantined = False
            else:
                self.states[r.index].lost = r.error

    def _after_failed_refit(self, error: BaseException, seconds: float,
                            version: str) -> FleetReport:
        """Find who holds what, quarantine the engines off the served version, raise."""
        timed = self.timed
        group_name = getattr(self.syncer and self.syncer.transport, "group_name", None)
        self._drop_syncer()   # the group is out of step after a failed broadcast
        deadline = time.monotonic() + self.timeout_s
        for t in timed:       # the survivors' last calls answer (or time out) first
            t.wait_answered(deadline - time.monotonic())
        found = [_with_version(r) for r in
                 self._fan_out("get_weight_version", lambda e: e.get_weight_version())]
        if group_name is not None:
            # an engine refuses to destroy a group while a receive cut off by the failure is
            # still in flight, so the teardown above can miss it; the next refit's group
            # would then be refused as already existing
            self._fan_out("destroy_weights_update_group",
                          lambda e: e.destroy_weights_update_group(group_name),
                          [r.index for r in found if r.ok])
        reached = any(r.version == version for r in found)
        serving = version if reached else self.version
        results = []
        for r in found:
            if not r.ok:
                self.states[r.index].lost = r.error
                results.append(r)
            elif r.version == serving:
                results.append(EngineResult(r.index, r.version == version, r.seconds,
                                            version=r.version))
            else:
                results.append(self._quarantine(r))
        if reached:
            self.version = version
        report = self._refit_report(results, seconds, 0, version)
        held = ", ".join(f"engine {r.index}: {r.version or 'unreachable'}"
                         + (" (quarantined)" if r.quarantined else "") for r in results)
        raise FleetRefitError(f"refit to {version!r} failed ({error}); versions now: {held}",
                              report) from error

    def _quarantine(self, found: EngineResult) -> EngineResult:
        """Make an engine off the served version refuse generation: abort what runs, release
        its weights (HTTP 503 / EngineAsleepError until the next refit)."""
        def isolate(engine: Any) -> None:
            engine.pause_generation("abort")
            engine.release_memory_occupation(["weights"])
        [done] = self._fan_out("quarantine", isolate, [found.index])
        if done.ok:
            self.states[found.index].quarantined = True
            return EngineResult(found.index, False, found.seconds, version=found.version,
                                error="not on the served version; quarantined",
                                quarantined=True)
        self.states[found.index].lost = done.error
        return EngineResult(found.index, False, found.seconds, version=found.version,
                            error=f"not on the served version and could not be quarantined "
                                  f"({done.error}); removed from the fleet")

    def _refit_report(self, results: list[EngineResult], seconds: float, moved: int,
                      version: str) -> FleetReport:
        return FleetReport("refit", seconds, results, bytes=moved, version=version,
                           transport=self.transport_name)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the weight-update group on the engines; the engines themselves stay up
        (the caller owns them)."""
        if not self.closed:
            self.closed = True
            self._drop_syncer()

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _with_version(result: EngineResult) -> EngineResult:
    """A get_weight_version result with its answer as `version`."""
    if not result.ok:
        return result
    version = result.answer.get("weight_version") if isinstance(result.answer, dict) \
        else result.answer
    return EngineResult(result.index, True, result.seconds, version=version)


def _bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()` in a daemon thread, given up on after `timeout_s`."""
    future = spawn(fn)
    done, _ = wait([future], timeout=timeout_s)
    if not done:
        raise TimeoutError(f"did not finish within {timeout_s:g} s")
    return future.result()

