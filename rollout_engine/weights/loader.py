"""Checkpoint reading and the one weight-application entry point.

``load_weights`` is used for the first load and for every later refit: it validates every name,
shape and dtype against the model's ``weight_map`` *before* changing any parameter, so a bad
payload leaves the old weights serving bit for bit.

dtypes follow SGLang (its weight loaders end in ``param.data.copy_(loaded_weight)``): a floating
tensor of another floating dtype is cast by the copy itself (bf16 from a trainer into an fp32
engine, an fp32 master into a bf16 one), with no temporary; any other mismatch (integer, bool,
complex, float <-> int) is refused, naming the weight.

Quantized models (``--quantization``): the incoming pairs (or, for the checks alone, their
``(name, shape, dtype)``) first go through the model's ``quant`` converter
(``quantization/convert.py``): a float weight of a quantized linear becomes its int8 weight
and scale (or its dequantized FP8 blocks) there, before any check, so the conversion is part
of the all-or-nothing update.

Tensor parallelism: incoming tensors are always the full checkpoint tensors; a rank's model
says which slice of each it holds (``tp_shards``), and that slice is what is checked against
the full shape and copied. Every rank checks its update, then all agree (``tp.commit``) before
any writes, so a refused update leaves every rank's weights as they were.
"""

from __future__ import annotations

import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from safetensors import safe_open

from rollout_engine.models import weight_writes
from rollout_engine.parallel.context import Shard
from rollout_engine.protocol.byte_copy import CopyPlan
from rollout_engine.quantization.convert import NoQuantizer


def read_hf_config(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_path!r} has no config.json: not a Hugging Face model directory")
    with open(path) as f:
        return json.load(f)


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint files of a directory: sharded (index.json) or a single model.safetensors."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"{model_path!r} contains no .safetensors weights")
    return [os.path.join(model_path, f) for f in found]


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` from every checkpoint file, one tensor at a time."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass(frozen=True)
class WeightLoadReport:
    """What one ``load_weights`` wrote: ``names`` are the HF names of the tensors copied (what
    the RL control plane counts to know when every weight has been rewritten after a wake)."""

    num_tensors: int
    num_bytes: int
    names: frozenset[str] = frozenset()
    num_cast: int = 0          # tensors converted to the parameter's dtype while copied


def load_weights(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    require_all: bool = False,
) -> WeightLoadReport:
    """Validate, then copy ``(hf_name, tensor)`` pairs into ``model`` (all or nothing).

    A floating tensor of another floating dtype is cast into the parameter as it is copied;
    other dtype mismatches are errors (`castable`).
    require_all: every parameter must be covered (the first load).
    Raises ValueError naming the first bad tensor; nothing has been written then.
    """
    plan = LoadPlan(model, named_tensors, require_all=require_all)
    plan.apply()
    return plan.report


class LoadPlan:
    """`load_weights` split in two: the constructor checks (all of it, raising ValueError
    before anything is written) and works out every copy; `apply` writes. A plan may be
    applied again for the very same source tensors (a trainer resending the same shared
    memory: `refit.MappedStorages`) while `valid`: no parameter it writes has been given
    other storage since (sleep and wake, a broadcast's shadow swap), which its copies would
    otherwise still point into (they keep that old storage alive, so it is never reused)."""

    def __init__(self, model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 *, require_all: bool = False) -> None:
        with agreed(model):
            checked = list(named_tensors)
            for name, tensor in checked:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"weight {name!r}: expected a tensor, got "
                                     f"{type(tensor).__name__}")
            quant = quantizer(model)
            checked = quant.convert(checked)
            plan = _checked_plan(model, [(n, tuple(t.shape), t.dtype) for n, t in checked],
                                 require_all)
        by_name = dict(checked)   # names are unique once plan_targets accepted them
        stacked = stacked_names(model)
        targets = [(name, param, _view(param, row0, rows,
                                        stacked[name][1] if name in stacked else None), shard)
                   for name, param, row0, rows, shard in plan]
        self.model = model
        self.converted = quant.active   # copies of tensors made here: never applied again
        self.copies = CopyPlan((dst, _source(by_name[name].detach(), shard))
                               for name, _, dst, shard in targets)
        self.storages = {id(p): (p, p.data_ptr()) for _, p, _, _ in targets}
        self.report = WeightLoadReport(
            num_tensors=len(targets),
            num_bytes=sum(dst.numel() * dst.element_size() for _, _, dst, _ in targets),
            names=covered_names(model, (n for n, _, _, _ in targets)),
            num_cast=sum(by_name[name].dtype != dst.dtype for name, _, dst, _ in targets))

    @property
    def valid(self) -> bool:
        """Every parameter written still has the storage it had when this was planned, and
        the copies read the caller's tensors (not ones a quantized model converted)."""
        return not self.converted and all(p.data_ptr() == ptr for p, ptr in self.storages.values())

    def apply(self) -> None:
        with weight_writes.writing(), torch.no_grad():   # casts if dtypes differ
            self.copies.run()


def _source(tensor: torch.Tensor, shard: Optional[Shard]) -> torch.Tensor:
    return tensor if shard is None else shard.of(tensor)


_NO_QUANT = NoQuantizer()


def quantizer(model: torch.nn.Module) -> NoQuantizer:
    """The model's conversion of what it is given (``quantization.convert``); a do-nothing
    one for a model without quantization."""
    return getattr(model, "quant", None) or _NO_QUANT


class agreed:
    """``with agreed(model): check...``: with tensor parallelism, every rank's checks end in
    one agreement (``tp.commit``) before anything is written: an error raised inside is every
    rank's refusal, another rank's refusal is raised here. Without it, nothing happens."""

    def __init__(self, model: torch.nn.Module) -> None:
        tp = getattr(model, "tp", None)
        self.commit = None if tp is None else tp.commit

    def __enter__(self) -> agreed:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.commit is not None:
            self.commit.agree(None if exc is None else f"{type(exc).__name__}: {exc}")


Target = tuple[str, torch.Tensor, Optional[Shard]]


_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def weight_table(model: torch.nn.Module) -> dict[str, Any]:
    """``model.weight_map()`` (HF name -> (parameter, first row, rows)), built once per model:
    its parameters are fixed objects whose storage refits and sleep replace (``param.data``),
    so the table stays true, and a bucketed refit's every call need not walk the model."""
    table = _TABLES.get(model)
    if table is None:
        table = _TABLES[model] = model.weight_map()  # type: ignore[operator]
    return table


def plan_targets(model: torch.nn.Module, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 *, require_all: bool = False) -> list[Target]:
    """Check ``(hf_name, shape, dtype)`` of every incoming tensor against ``model`` and return
    (name, destination view in the parameter, the slice of the incoming tensor that goes there:
    None for all of it) for each one to copy, in order. Skips ignored weights and a tied
    checkpoint's ``lm_head.weight``. Raises ValueError naming the first bad tensor (unknown,
    twice, wrong shape, uncastable dtype; with ``require_all``, missing)."""
    # views made afresh: sleep and refits may have given a parameter new storage since
    stacked = stacked_names(model)
    specs = quantizer(model).convert_specs(specs)
    return [(name, _view(param, row0, rows, stacked[name][1] if name in stacked else None),
             shard)
            for name, param, row0, rows, shard in _checked_plan(model, specs, require_all)]


_STACKED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any]] = \
    weakref.WeakKeyDictionary()


def covered_names(model: torch.nn.Module, names: Iterable[str]) -> frozenset[str]:
    """The ``weight_map`` names that tensors under ``names`` write (a stacked name stands for
    each of its experts')."""
    stacked = stacked_names(model)
    return frozenset(c for n in names for c in (stacked[n][2] if n in stacked else (n,)))


def stacked_names(model: torch.nn.Module) -> dict[str, Any]:
    """``model.stacked_names()`` (built once): names whose tensor fills a whole parameter in
    another shape -> (parameter, incoming shape, the table names it stands for)."""
    names = _STACKED.get(model)
    if names is None:
        fn = getattr(model, "stacked_names", None)
        names = _STACKED[model] = {} if fn is None else fn()
    return names


def _view(param: torch.nn.Parameter, row0: int, rows: int,
          shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    view = param.data if param.dim() == 0 else param.data.narrow(0, row0, rows)
    return view if shape is None else view.view(shape)


def _checked_plan(model: torch.nn.Module,
                  specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                  require_all: bool) -> list[tuple[str, torch.nn.Parameter, int, int,
                                                   Optional[Shard]]]:
    """`_plan` of these specs, checked once per distinct list (`_PLANS`)."""
    specs = tuple((name, tuple(shape), dtype) for name, shape, dtype in specs)
    plans = _PLANS.get(model)
    if plans is None:
        plans = _PLANS[model] = OrderedDict()
    key = (specs, require_all)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _plan(model, specs, require_all)
        while len(plans) > _PLANS_KEPT:
            plans.popitem(last=False)
    else:
        plans.move_to_end(key)
    return plan


# Each model's checked plans of recent updates, by their (name, shape, dtype) lists: a trainer
# sends the same list every refit, so it is checked once (~4 us a tensor), not every time.
_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict[Any, list[Any]]] = \
    weakref.WeakKeyDictionary()
_PLANS_KEPT = 512   # a large model refitted in small buckets sends hundreds of lists


def _plan(model: torch.nn.Module, specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
          require_all: bool) -> list[tuple[str, torch.nn.Parameter, int, int, Optional[Shard]]]:
    """`plan_targets`' checks; (name, parameter, first row, rows, shard) of each target."""
    table = weight_table(model)
    ignored = getattr(model, "ignored_weight", lambda name: False)
    shards: dict[str, Shard] = (model.tp_shards()  # type: ignore[operator]
                                if getattr(model, "tp", None) is not None else {})
    stacked = stacked_names(model)
    targets: list[tuple[str, torch.nn.Parameter, int, int, Optional[Shard]]] = []
    seen: set[str] = set()
    for name, shape, dtype in specs:
        if ignored(name):
            continue
        if name == "lm_head.weight" and name not in table:
            continue  # tied embeddings: the checkpoint may still carry a copy
        if name in stacked:   # one tensor for many table names
            param, expected, covers = stacked[name]
            row0, rows = 0, param.shape[0]
        elif name in table:
            (param, row0, rows), covers = table[name], (name,)
            expected = (rows, *param.shape[1:]) if param.dim() else ()
        else:
            raise ValueError(f"unknown weight name {name!r} (not a parameter of this model)")
        for covered in covers:
            if covered in seen:
                raise ValueError(f"weight {name!r} appears twice in one update")
            seen.add(covered)
        shard = shards.get(name)
        if shard is not None:
            expected = shard.full_shape
        if tuple(shape) != tuple(expected):
            raise ValueError(f"weight {name!r}: shape {tuple(shape)} does not match the "
                             f"model's {tuple(expected)}")
        if not castable(dtype, param.dtype):
            raise ValueError(f"weight {name!r}: dtype {dtype} does not match the "
                             f"model's {param.dtype} (only floating-point weights are cast)")
        targets.append((name, param, row0, rows, shard))
    if require_all:
        missing = sorted(set(table) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:3]}")
    return targets


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """May a ``src`` tensor be loaded into a ``dst`` parameter? The same dtype, or both floating
    point (SGLang's loaders cast those; an integer or bool mismatch is a wrong payload)."""
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def weight_names(model: torch.nn.Module) -> frozenset[str]:
    """Every HF name ``load_weights`` accepts for ``model`` (what a full refit writes)."""
    return frozenset(model.weight_map())  # type: ignore[operator]


def read_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The current value of a parameter by its Hugging Face name (a view, not a copy)."""
    table = weight_table(model)
    if name not in table:
        if name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        else:
            raise ValueError(f"unknown weight name {name!r}")
    param, row0, rows = table[name]
    return param.data if param.dim() == 0 else param.data.narrow(0, row0, rows)
