"""Refitting a STANDALONE draft: which weights of an update are the draft's, and loading both.

SGLang's wire form (``io_struct.py``): ``update_weights_from_tensor`` and
``update_weights_from_distributed`` take ``selector`` (``"target"``, ``"draft"`` or ``"all"``:
which model runners the update is loaded into); ``update_weights_from_tensor`` also takes the
older ``disable_draft_model`` (true: the target only). SGLang loads the same tensors into every
selected runner and each keeps the names it has, which fits an MTP / EAGLE head (names the target
lacks) but not a STANDALONE draft: a second small model whose names are the target's own
(``model.layers.0...``). So here, per selector:

    "target"           every name is the target's        (a ``draft.`` name is refused)
    "draft"            every name is the draft's         (``draft.`` prefix optional)
    "all" / None       ``draft.<name>`` -> the draft's ``<name>``; any other name -> the target

so one payload or one broadcast refits both (the trainer prefixes its draft parameters with
``draft.``), and a plain update (no ``draft.`` names) refits the target alone, as before.
``update_weights_from_disk`` (SGLang reloads an MTP draft from the target's ``model_path``;
a STANDALONE draft has its own checkpoint) takes ``selector`` and ``draft_model_path`` (ours):
``"all"`` / None reads ``model_path`` into the target and ``draft_model_path`` (when given) into
the draft, ``"target"`` only the target, ``"draft"`` reads ``model_path`` into the draft.

Every update is validated for both models before either is written (a bad name, shape or dtype
anywhere changes nothing), then counts as one weight generation: the radix tree keys KV by
generation and the draft's KV lives at the target's slots, so a refit of either model retires
the cached KV of both (a draft refit alone retires the target's too: cheap to recompute, and
never a draft KV row of old weights reused). ``get_weights_by_name("draft.<name>")`` reads the
draft. A wake without CPU backup reloads the draft from its last checkpoint (the startup one or
the last disk refit's): refit it again after waking to bring a trainer's draft back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Unpack

import torch
from torch import nn

from rollout_engine.compat.update_requests import SglangFlags, SglangUpdateFlags
from rollout_engine.control.rl_control import MAX_TRUNCATE_ROWS, MAX_WEIGHT_ELEMENTS, RLControl
from rollout_engine.protocol.messages import BusyError, WeightSlice
from rollout_engine.speculative.selector import DRAFT_PREFIX, resolve_selector
from rollout_engine.weights.disk_reader import PartialLoadError, load_checkpoint, read_header
from rollout_engine.weights.loader import (
    WeightLoadReport,
    iter_safetensors,
    load_weights,
    plan_targets,
    read_weight,
    safetensors_files,
)
from rollout_engine.weights.refit import NamedTensors

if TYPE_CHECKING:
    from rollout_engine.speculative.draft import DraftModel

__all__ = ["DraftRLControl", "check_checkpoint", "split_for_draft"]



def split_for_draft(names: list[str], selector: str) -> tuple[list[int], list[str]]:
    """Which of ``names`` are the draft's, under ``selector``: (their indices, their names in
    the draft). The rest are the target's."""
    if selector == "draft":
        return list(range(len(names))), [n.removeprefix(DRAFT_PREFIX) for n in names]
    drafted = [i for i, n in enumerate(names) if n.startswith(DRAFT_PREFIX)]
    if selector == "target" and drafted:
        raise ValueError(f"weight {names[drafted[0]]!r}: a draft weight in an update whose "
                         "selector is 'target' (or disable_draft_model is true)")
    return drafted, [names[i][len(DRAFT_PREFIX):] for i in drafted]


def _combined(target: Optional[WeightLoadReport], draft: Optional[WeightLoadReport]
              ) -> WeightLoadReport:
    """One report for the update; ``names`` only the target's (the control plane counts them
    against the target's weights still missing after a wake)."""
    parts = [r for r in (target, draft) if r is not None]
    return WeightLoadReport(num_tensors=sum(r.num_tensors for r in parts),
                      num_bytes=sum(r.num_bytes for r in parts),
                      names=target.names if target is not None else frozenset(),
                      num_cast=sum(r.num_cast for r in parts))


def check_checkpoint(model: nn.Module, path: str) -> None:
    """Validate a checkpoint's names, shapes and dtypes against ``model`` without writing."""
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for shard in safetensors_files(path):
        entries = read_header(shard)
        if entries is None:      # a dtype the header reader does not map: read the tensors
            specs = [(n, tuple(t.shape), t.dtype) for n, t in iter_safetensors(path)]
            break
        specs.extend((e.name, e.shape, e.dtype) for e in entries)
    plan_targets(model, specs)


class DraftRLControl(RLControl):
    """The RL control calls of an engine with a STANDALONE draft: the weight updates route to
    the target, the draft or both (module docstring); everything else is ``RLControl``'s."""

    def __init__(self, draft: DraftModel, **parts: Any) -> None:
        """``parts``: ``RLControl``'s collaborators."""
        super().__init__(**parts)
        self.draft = draft

    @property
    def _target(self) -> nn.Module:
        return self.runner.model

    def checked_models(self, selector: str) -> list[tuple[str, nn.Module]]:
        """The target and / or the draft (its weights named ``draft.<name>``)."""
        draft = [("draft", self.draft.runner.model)] if selector in ("draft", "all") else []
        return [*super().checked_models(selector), *draft]

    # -- disk ------------------------------------------------------------------------------------
    def rpc_update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                     weight_version: Optional[str] = None,
                                     flush_cache: bool = True,
                                     abort_all_requests: bool = False,
                                     torch_empty_cache: bool = False, keep_pause: bool = False,
                                     selector: Optional[str] = None,
                                     draft_model_path: Optional[str] = None,
                                     **sglang_flags: Unpack[SglangFlags]
                                     ) -> dict[str, Any]:
        sel = resolve_selector(selector)
        if draft_model_path is not None and sel != "all":
            raise ValueError(f"draft_model_path: only with selector 'all' (or null); with "
                             f"{sel!r} model_path names the one checkpoint to read")
        if sel == "target" or (sel == "all" and draft_model_path is None):
            return super().rpc_update_weights_from_disk(
                model_path, load_format, weight_version, flush_cache, abort_all_requests,
                torch_empty_cache, keep_pause, **sglang_flags)
        draft_path = draft_model_path

        def load() -> WeightLoadReport:
            if draft_path is None:          # selector "draft": model_path is the draft's
                return _combined(None, self._read_draft(model_path))
            return self._read_both(model_path, draft_path)

        return self._disk_update(load, load_format, weight_version, flush_cache,
                                 abort_all_requests, torch_empty_cache, keep_pause,
                                 **sglang_flags)

    def _read_draft(self, path: str) -> WeightLoadReport:
        try:
            report = load_checkpoint(self.draft.runner.model, path)
        except PartialLoadError as e:
            # a draft half written costs acceptance only (the target decides every token)
            raise ValueError(f"draft: {e}; outputs stay exact, refit the draft again") from None
        self.draft.path = path       # what a wake without CPU backup reloads
        return report

    def _read_both(self, model_path: str, draft_path: str) -> WeightLoadReport:
        try:
            check_checkpoint(self.draft.runner.model, draft_path)
        except ValueError as e:
            raise ValueError(f"draft_model_path: {e}") from None
        target = self._read_checkpoint(model_path)
        return _combined(target, self._read_draft(draft_path))

    # -- tensors ---------------------------------------------------------------------------------
    def _tensor_destination(self, flags: SglangUpdateFlags
                            ) -> tuple[nn.Module, Callable[[NamedTensors], WeightLoadReport]]:
        """Read against both models; each tensor goes where SGLang's ``selector`` (or
        ``disable_draft_model``) sends it."""
        sel = resolve_selector(flags.pop("selector", None), flags.pop("disable_draft_model", None))
        both = nn.ModuleList([self._target, self.draft.runner.model])
        return both, lambda named: self._load_named(named, sel)

    def _load_named(self, named: NamedTensors, selector: str) -> WeightLoadReport:
        """Split, validate both halves, then write the target's and the draft's."""
        indices, draft_names = split_for_draft([n for n, _ in named], selector)
        ours = set(indices)
        draft_part = [(name, named[i][1]) for i, name in zip(indices, draft_names)]
        target_part = [x for i, x in enumerate(named) if i not in ours]
        draft_model = self.draft.runner.model
        try:
            plan_targets(draft_model, [(n, tuple(t.shape), t.dtype) for n, t in draft_part])
        except ValueError as e:
            raise ValueError(f"draft: {e}") from None
        target = load_weights(self._target, target_part) if target_part else None
        draft = load_weights(draft_model, draft_part) if draft_part else None
        return _combined(target, draft)

    # -- broadcast -------------------------------------------------------------------------------
    def _load_broadcast(self, received: NamedTensors, sglang_flags: SglangUpdateFlags
                        ) -> WeightLoadReport:
        """A received broadcast (drained before anything is refused), routed by ``selector``."""
        return self._load_named(received, resolve_selector(sglang_flags.get("selector")))

    def _before_update(self, abort_all_requests: bool, selector: Optional[str] = None,
                       draft_model_path: Optional[str] = None, **flags: Any) -> None:
        """The base checks, minus the draft's fields (routed here, refused there)."""
        super()._before_update(abort_all_requests, **flags)

    # -- reads -----------------------------------------------------------------------------------
    def rpc_get_weights_by_name(self, name: str, truncate_size: int = 100) -> WeightSlice:
        """``draft.<name>``: the draft's weight ``<name>``, within the target's read bounds."""
        if not (isinstance(name, str) and name.startswith(DRAFT_PREFIX)):
            return super().rpc_get_weights_by_name(name, truncate_size)
        if (not isinstance(truncate_size, int) or isinstance(truncate_size, bool)
                or not 1 <= truncate_size <= MAX_TRUNCATE_ROWS):
            raise ValueError(f"truncate_size: must be an integer in [1, {MAX_TRUNCATE_ROWS}], "
                             f"got {truncate_size!r}")
        if "weights" in self.memory_saver.released:
            raise BusyError("weights are released")
        t = read_weight(self.draft.runner.model, name[len(DRAFT_PREFIX):])
        part = t[:truncate_size] if t.dim() else t
        if part.numel() > MAX_WEIGHT_ELEMENTS:
            raise ValueError(f"truncate_size: {truncate_size} rows of {name!r} hold "
                             f"{part.numel()} elements, over the {MAX_WEIGHT_ELEMENTS} one read "
                             "may return")
        flat = part.detach().float().contiguous().cpu()
        return WeightSlice(list(flat.shape), flat.numpy().tobytes())
