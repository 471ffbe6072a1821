"""SGLang's ``/weights_checker`` as a control call (``weights_checker``), over the served models.

slime (``--check-weight-update-equal``), miles and NeMo-RL prove a refit with it: ``snapshot``
and ``reset_tensors`` when the engine starts (on the weights it loaded from the checkpoint the
trainer starts from too), the first refit, then ``compare``; miles also logs a ``checksum`` after
every update. The checks themselves are ``weights/checker.py``'s; this adds what the engine must
keep true around them:

    selector        ``target``, ``draft`` (a STANDALONE draft model's weights, named
                    ``draft.<name>``) or ``all``; a selector naming no model here checks nothing
    reset_tensors   refused (409) while a request holds KV; the weights it overwrote count as
                    unwritten (``WeightState.missing``): nothing is generated from random
                    weights, and the first refit that rewrites them all makes the engine serve
                    again. Its KV generation is retired, as after any weight change
    compare         a difference is a 400 whose message lists each weight (SGLang answers
                    ``{"success": false}`` with status 400 too); a role without a snapshot
                    is a 400 that says to take one
    checksum        the answer's ``ranks``: one entry per GPU rank (SGLang's ``ChecksumInfo``:
                    ``checksums``, ``per_gpu_checksum``, ``parallelism_info`` with a ``role``
                    per model), tensor-parallel ranks appended by rank 0 and data-parallel
                    replicas' by the merge (``dp/merge.py``), which fills in ``dp_rank`` / ``rank``

Every action is refused (409) while the weights are released. A snapshot is kept per model
until the next one replaces it (a host copy of the weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from rollout_engine.control.serving import Serving
from rollout_engine.memory.memory_saver import MemorySaver
from rollout_engine.protocol.messages import BusyError
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.weight_state import WeightState
from rollout_engine.speculative.selector import DRAFT_PREFIX, SELECTORS
from rollout_engine.weights import checker

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")

Models = Callable[[str], list[tuple[str, nn.Module]]]
"""selector -> the (role, model) pairs it names: ``target`` first, then ``draft``."""


def parallelism_info(role: str, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """SGLang's ``ParallelismInfo`` of one model on one rank, with its role (one replica,
    one pipeline stage; ``dp/merge.py`` fills in the data-parallel fields)."""
    return {"role": role, "tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1,
            "pp_rank": 0, "pp_size": 1, "rank": tp_rank, "size": tp_size}


def check_args(action: str, selector: str, skip_tensor_list: Optional[list[str]]) -> list[str]:
    """Refuse an action or selector SGLang does not define; the skip patterns as a list."""
    if action not in ACTIONS:
        raise ValueError(f"action: must be one of {list(ACTIONS)}, got {action!r}")
    if selector not in SELECTORS:
        raise ValueError(f"selector: must be one of {list(SELECTORS)}, got {selector!r}")
    return list(skip_tensor_list or ())


class RankChecker:
    """One rank's snapshots and checks of the models it serves (rank 0 and every other
    tensor-parallel rank hold one)."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}   # role -> name -> copy

    def run(self, action: str, models: list[tuple[str, nn.Module]], skip: list[str]
            ) -> dict[str, Any]:
        """``action`` over ``models`` (arguments checked); raises ValueError when a compare
        fails. Returns ``reset`` (role -> names written), ``ranks`` for a checksum."""
        out: dict[str, Any] = {"action": action, "roles": [role for role, _ in models]}
        if action == "snapshot":
            for role, model in models:
                self.snapshots[role] = checker.snapshot(model)
        elif action == "reset_tensors":
            out["reset"] = {role: checker.reset(model, skip) for role, model in models}
        elif action == "compare":
            tolerated = []
            for role, model in models:
                snap = self.snapshots.get(role)
                if snap is None:
                    raise ValueError(f"compare: no snapshot of the {role} weights; call "
                                     "weights_checker with action 'snapshot' first")
                _, skipped = checker.check_equal(snap, model, skip)
                tolerated += [m.describe() for m in skipped]
            out["tolerated"] = tolerated   # differences in skip_tensor_list's names
        elif models:
            sums: dict[str, str] = {}
            for role, model in models:
                prefix = "" if role == "target" else DRAFT_PREFIX
                sums.update({prefix + k: v for k, v in checker.checksums(model, skip).items()})
            out["ranks"] = [{"checksums": sums, "per_gpu_checksum": checker.overall(sums),
                             "parallelism_info": [parallelism_info(role, self.tp_rank,
                                                                   self.tp_size)
                                                  for role, _ in models]}]
        else:
            out["ranks"] = []
        return out


class WeightChecks:
    """``weights_checker`` on rank 0, over the models ``models`` names, with the scheduler's
    request side, KV, weight state and memory saver to keep their invariants."""

    def __init__(self, models: Models, serving: Serving, kv: KVManager, weights: WeightState,
                 memory_saver: MemorySaver, tp_size: int = 1) -> None:
        self.models = models
        self.serving = serving
        self.kv = kv
        self.weights = weights
        self.memory_saver = memory_saver
        self.rank = RankChecker(0, tp_size)

    def rpc_weights_checker(self, action: str = "checksum", allow_quant_error: bool = False,
                            selector: str = "all",
                            skip_tensor_list: Optional[list[str]] = None) -> dict[str, Any]:
        """SGLang's ``CheckWeightsReqInput``: see the module docstring."""
        skip = check_args(action, selector, skip_tensor_list)
        if "weights" in self.memory_saver.released:
            raise BusyError("weights_checker: the weights are released; "
                            "resume_memory_occupation(['weights']) first")
        if action == "reset_tensors" and self.serving.active_reqs():
            raise BusyError(f"weights_checker reset_tensors: {len(self.serving.active_reqs())} "
                            "request(s) hold KV; pause_generation (abort or retract) or wait "
                            "until idle")
        out = self.rank.run(action, self.models(selector), skip)
        written = out.get("reset", {}).get("target")
        if written:   # random weights: nothing is served until a refit writes them again
            self.kv.tree.retire_generations_before(self.weights.partly_written(written))
        out["allow_quant_error"] = allow_quant_error
        return out
