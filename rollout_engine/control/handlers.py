"""The control plane over one scheduler, composed in one place.

``build_control`` gives each group of control calls the collaborators it uses (the scheduler's
request side as ``Serving``, its runner, KV manager, allocator, memory saver and weight state)
and builds the table ``method name -> handler`` once; ``ControlPlane`` is what the loop talks
to. The scheduler never learns that any of this exists: a request or an abort goes to its
``handle``, a ``ControlReq`` through the table (``dispatch.py``: deadlines, deferred answers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

from rollout_engine.control.dispatch import Canceller, ControlDispatcher, Handler
from rollout_engine.control.draft_refit import DraftRLControl
from rollout_engine.control.introspection import Introspection
from rollout_engine.control.lora_control import LoraControl
from rollout_engine.control.profiler import Profiler
from rollout_engine.control.rl_control import RLControl
from rollout_engine.control.vllm_control import VllmControl
from rollout_engine.control.vllm_transfer import VllmTransfer
from rollout_engine.control.weight_checks import WeightChecks
from rollout_engine.protocol.messages import AbortReq, ControlReq, ControlResult, GenerateReq
from rollout_engine.scheduler.scheduler import Scheduler
from rollout_engine.speculative.scheduler import SpeculativeScheduler
from rollout_engine.weights.update_groups import WeightUpdateGroups

__all__ = ["CALLS", "ControlPlane", "build_control", "declared_calls", "handler_table"]


# every control call the engine answers: name -> (owner, method); the owner classes'
# annotations are the calls' declared argument types (``call_types.py``)
CALLS: dict[str, tuple[str, str]] = {
    # cache and introspection
    "flush_cache": ("info", "rpc_flush_cache"),
    "check_integrity": ("info", "rpc_check_integrity"),
    "get_server_info": ("info", "rpc_get_server_info"),
    "get_load": ("info", "rpc_get_load"),
    # sleep / wake
    "release_memory_occupation": ("rl", "rpc_release_memory_occupation"),
    "resume_memory_occupation": ("rl", "rpc_resume_memory_occupation"),
    # refit
    "update_weights_from_disk": ("rl", "rpc_update_weights_from_disk"),
    "update_weights_from_tensor": ("rl", "rpc_update_weights_from_tensor"),
    "init_weights_update_group": ("rl", "rpc_init_weights_update_group"),
    "update_weights_from_distributed": ("rl", "rpc_update_weights_from_distributed"),
    "destroy_weights_update_group": ("rl", "rpc_destroy_weights_update_group"),
    "get_weights_by_name": ("rl", "rpc_get_weights_by_name"),
    # versions and pausing
    "get_weight_version": ("rl", "rpc_get_weight_version"),
    "update_weight_version": ("rl", "rpc_update_weight_version"),
    "pause_generation": ("rl", "rpc_pause_generation"),
    "continue_generation": ("rl", "rpc_continue_generation"),
    # the weight-update session and the weight checker
    "begin_weight_update": ("rl", "rpc_begin_weight_update"),
    "end_weight_update": ("rl", "rpc_end_weight_update"),
    "post_process_weights": ("rl", "rpc_post_process_weights"),
    "weights_checker": ("checks", "rpc_weights_checker"),
    # the torch profiler
    "start_profile": ("profiler", "rpc_start_profile"),
    "stop_profile": ("profiler", "rpc_stop_profile"),
    # LoRA adapters
    "load_lora_adapter": ("lora", "rpc_load_lora_adapter"),
    "load_lora_adapter_from_tensors": ("lora", "rpc_load_lora_adapter_from_tensors"),
    "unload_lora_adapter": ("lora", "rpc_unload_lora_adapter"),
    "list_lora_adapters": ("lora", "rpc_list_lora_adapters"),
    # vLLM's pause modes and prefix-cache reset (its sleep / wake are the memory calls)
    "vllm_pause": ("vllm", "rpc_vllm_pause"),
    "vllm_resume": ("vllm", "rpc_vllm_resume"),
    "vllm_pause_state": ("vllm", "rpc_vllm_pause_state"),
    "reset_prefix_cache": ("vllm", "rpc_reset_prefix_cache"),
    # vLLM's native weight transfer (its routes: entrypoints/vllm_weight_routes.py)
    "vllm_init_weight_transfer": ("transfer", "rpc_vllm_init_weight_transfer"),
    "vllm_start_weight_update": ("transfer", "rpc_vllm_start_weight_update"),
    "vllm_update_weights": ("transfer", "rpc_vllm_update_weights"),
    "vllm_finish_weight_update": ("transfer", "rpc_vllm_finish_weight_update"),
    "vllm_shutdown_weight_transfer": ("transfer", "rpc_vllm_shutdown_weight_transfer"),
}
OWNER_CLASSES: dict[str, type] = {"info": Introspection, "rl": RLControl, "checks": WeightChecks,
                                  "profiler": Profiler, "lora": LoraControl,
                                  "vllm": VllmControl, "transfer": VllmTransfer}


def declared_calls() -> dict[str, Callable[..., Any]]:
    """Every control call's handler as its class declares it (unbound: for its signature)."""
    return {name: getattr(OWNER_CLASSES[owner], attr) for name, (owner, attr) in CALLS.items()}


def handler_table(info: Introspection, rl: RLControl, profiler: Profiler,
                  lora: LoraControl, vllm: VllmControl) -> dict[str, Handler]:
    """Every control call the engine answers, by the name a ``ControlReq`` gives."""
    owners: dict[str, Any] = {"info": info, "rl": rl, "checks": rl.checks, "profiler": profiler,
                              "lora": lora, "vllm": vllm, "transfer": VllmTransfer(rl)}
    return {name: getattr(owners[owner], attr) for name, (owner, attr) in CALLS.items()}


class ControlPlane:
    """Routes the loop's messages: requests and aborts to the scheduler, control calls through
    the handler table. ``finished`` yields the answers of deferred calls that have ended;
    ``wake`` (set by the loop) is called when one ends."""

    def __init__(self, scheduler: Scheduler, handlers: Mapping[str, Handler],
                 cancellers: Mapping[str, Canceller], profiler: Profiler,
                 vllm: VllmControl) -> None:
        self.scheduler = scheduler
        self.handlers = handlers
        self.profiler = profiler
        self.vllm = vllm
        self.dispatcher = ControlDispatcher(handlers, cancellers)

    def handle(self, msg: Union[GenerateReq, AbortReq, ControlReq]) -> Optional[ControlResult]:
        """The answer to a control call (None while it is deferred, and for anything else)."""
        if isinstance(msg, ControlReq):
            return self.dispatcher.dispatch(msg)
        self.scheduler.handle(msg)
        return None

    def finished(self) -> list[ControlResult]:
        """Called after every step: deferred answers (a ``wait`` pause that drained among
        them), and the profiler's start / stop step."""
        self.profiler.poll()
        self.vllm.poll()
        return self.dispatcher.finished()

    @property
    def wake(self) -> Callable[[], None]:
        return self.dispatcher.wake

    @wake.setter
    def wake(self, wake: Callable[[], None]) -> None:
        self.dispatcher.wake = wake

    def server_info(self) -> dict[str, Any]:
        """``get_server_info``'s answer (what the loop announces the scheduler with)."""
        info: dict[str, Any] = self.handlers["get_server_info"]()
        return info


def build_control(scheduler: Scheduler) -> ControlPlane:
    """Compose the control plane over a built scheduler (a STANDALONE draft's refits address
    the draft too: ``draft_refit.py``)."""
    parts: dict[str, Any] = dict(
        serving=scheduler, runner=scheduler.runner, kv=scheduler.kv,
        allocator=scheduler.allocator, memory_saver=scheduler.memory_saver,
        weights=scheduler.weights, groups=WeightUpdateGroups(scheduler.device),
        group_timeout_s=scheduler.config.weight_update_group_timeout)
    draft = scheduler.draft if isinstance(scheduler, SpeculativeScheduler) else None
    rl = RLControl(**parts) if draft is None else DraftRLControl(draft, **parts)
    info = Introspection(scheduler, scheduler.runner, scheduler.kv, scheduler.allocator,
                         scheduler.memory_saver, scheduler.weights, rl.groups, rl.spare_bytes)
    cancellers = {"update_weights_from_tensor": rl.cancel_update_weights_from_tensor}
    profiler = Profiler(lambda: scheduler.stats["forward_passes"], scheduler.device)
    lora = LoraControl(scheduler.lora, scheduler.runner.model)
    vllm = VllmControl(scheduler, scheduler.kv, scheduler.weights, rl)
    return ControlPlane(scheduler, handler_table(info, rl, profiler, lora, vllm), cancellers,
                        profiler, vllm)
