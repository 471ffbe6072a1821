"""The broadcast half of the RL control plane (``RLControl`` inherits it): weight-update groups
joined off the loop, and ``update_weights_from_distributed`` received off the loop and applied
in call order once complete (``weights/update_groups.py``), unbucketed updates straight into
spare parameter storage (``weights/shadow.py``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional, Unpack

import torch

from rollout_engine.compat.update_requests import SglangUpdateFlags
from rollout_engine.control.dispatch import Deferred
from rollout_engine.memory.memory_saver import MemorySaver
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.protocol.messages import BusyError
from rollout_engine.weights import refit
from rollout_engine.weights.loader import WeightLoadReport, load_weights
from rollout_engine.weights.shadow import InPlacePlan, ShadowWeights
from rollout_engine.weights.update_groups import WeightUpdateGroups


class BroadcastRefits:
    """Needs ``runner``, ``memory_saver``, ``groups``, ``group_timeout_s``, ``shadow`` and the
    update steps ``_before_update`` / ``_apply`` of ``RLControl``."""

    runner: ModelRunner
    memory_saver: MemorySaver
    groups: WeightUpdateGroups
    group_timeout_s: float
    shadow: Optional[ShadowWeights]

    if TYPE_CHECKING:
        def _before_update(self, abort_all_requests: bool, **flags: Any) -> None: ...

        def _apply(self, load: Any, weight_version: Optional[str], flush_cache: bool,
                   torch_empty_cache: bool = False, keep_pause: bool = False
                   ) -> dict[str, Any]: ...

    def rpc_init_weights_update_group(self, master_address: str, master_port: int,
                                      rank_offset: int, world_size: int,
                                      group_name: str = "weight_update_group",
                                      backend: str = "nccl") -> Deferred:
        """Join the trainer's group; the rendezvous runs off the loop (requests keep being
        served) and waits at most ``weight_update_group_timeout`` seconds."""
        groups = self.groups
        future = groups.start_init(master_address, master_port, rank_offset, world_size,
                                   group_name, backend, self.group_timeout_s)

        def finish(done: Future) -> dict[str, Any]:
            groups.finish_init(group_name, done)
            return {"group_name": group_name}

        return Deferred(future, finish)

    def rpc_update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                            shapes: list[list[int]],
                                            group_name: str = "weight_update_group",
                                            load_format: Optional[str] = None,
                                            flush_cache: bool = True,
                                            weight_version: Optional[str] = None,
                                            abort_all_requests: bool = False,
                                            torch_empty_cache: bool = False,
                                            **sglang_flags: Unpack[SglangUpdateFlags]
                                            ) -> Deferred:
        """Receive the broadcast in the declared ``dtypes``, then load (floating tensors are
        cast into the parameters). ``sglang_flags``: pp_rank. The receives are posted and the
        call returns to the loop: the update is applied (in the order the calls came) once
        all of it has arrived, while the loop keeps serving and posts the next call's receives
        (a bucketed trainer's next bucket arrives while this one is applied). The broadcast is
        drained before anything is refused, so a refused update never leaves the trainer
        hanging."""
        groups = self.groups
        previous = groups.in_flight[-1] if groups.in_flight else None
        plan = self._in_place_plan(names, dtypes, shapes, load_format, sglang_flags)
        shadow = self._shadow()
        try:
            receipt = groups.post(list(names), list(dtypes), shapes, group_name, load_format,
                                  after=previous, into=None if plan is None else plan.views)
        except BaseException:
            if plan is not None:
                shadow.abort(plan)
            raise

        def finish(done: Future) -> dict[str, Any]:
            committed = False
            try:
                received = done.result()
                self._before_update(abort_all_requests, weight_version=weight_version,
                                    flush_cache=flush_cache, torch_empty_cache=torch_empty_cache,
                                    **sglang_flags)
                if plan is None:
                    load = lambda: self._load_broadcast(received, sglang_flags)  # noqa: E731
                else:
                    load = lambda: shadow.commit(plan)  # noqa: E731
                result = self._apply(load, weight_version, flush_cache, torch_empty_cache)
                committed = True
                return result
            finally:
                if plan is not None and not committed:
                    shadow.abort(plan)
                groups.settle(receipt)

        return Deferred(receipt.future, finish)

    def _in_place_plan(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                       load_format: Optional[str], sglang_flags: SglangUpdateFlags
                       ) -> Optional[InPlacePlan]:
        """Receive an unbucketed update straight into spare parameter storage
        (`weights/shadow.py`) when it is a plain target update the model takes as announced;
        None: staged and copied. Malformed announcements are left to ``post`` to refuse."""
        if (load_format is not None or sglang_flags.get("selector") not in (None, "target", "all")
                or self.runner.device.type != "cpu" or "weights" in self.memory_saver.released):
            return None
        try:
            torch_dtypes = [refit.declared_dtype(d) for d in dtypes]
            shapes_t = [tuple(int(d) for d in s) for s in shapes]
        except (ValueError, TypeError):
            return None
        if not len(names) == len(torch_dtypes) == len(shapes_t):
            return None
        return self._shadow().plan(list(names), torch_dtypes, shapes_t)

    def _shadow(self) -> ShadowWeights:
        if self.shadow is None:
            self.shadow = ShadowWeights(self.runner.model)
        return self.shadow

    def _load_broadcast(self, received: list[tuple[str, torch.Tensor]],
                        sglang_flags: SglangUpdateFlags) -> WeightLoadReport:
        """Load a received broadcast (a speculative engine also routes draft weights)."""
        return load_weights(self.runner.model, received)

    def _refuse_while_receiving(self, what: str) -> None:
        if self.groups.receiving():
            raise BusyError(f"{what}: a distributed weight update is still being received; "
                            "wait for its answer")

    def rpc_destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                         ) -> dict[str, Any]:
        groups = self.groups
        groups.destroy(group_name)
        if not groups.groups and self.shadow is not None:
            self.shadow.release()   # no group left to receive into the spare weights
        return {"group_name": group_name}
