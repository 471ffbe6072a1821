"""The dense SwiGLU MLP (``down(silu(gate(x)) * up(x))``, gate and up in one product) of the
decoder layers and of Qwen2-MoE's shared expert."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from rollout_engine.models.layers import silu_mul
from rollout_engine.models.quant_linear import make_linear, make_merged
from rollout_engine.models.tp_layers import RowParallelLinear
from rollout_engine.parallel.context import TPContext


class MLP(nn.Module):
    """SwiGLU of ``intermediate_size`` (this rank's part with ``tp``); ``reduce=False`` leaves
    the ranks' partial sums for the caller to reduce (a MoE layer's shared expert).
    ``layer_id``: the decoder layer whose MLP this is, where LoRA adapters apply (none on a
    shared expert). ``quant``: the quantization method of its projections (None: the
    model's dtype)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 tp: Optional[TPContext] = None, reduce: bool = True,
                 layer_id: Optional[int] = None, quant: Optional[str] = None) -> None:
        super().__init__()
        i = intermediate_size
        self.layer_id = layer_id
        self.gate_up_proj = make_merged(hidden_size, [i, i], bias, quant)
        self.down_proj: nn.Module = (
            RowParallelLinear(i, hidden_size, bias, tp) if tp is not None and reduce
            else make_linear(i, hidden_size, bias, quant))

    def forward(self, x: torch.Tensor, fb: Any = None) -> torch.Tensor:
        lora = fb.lora if fb is not None and self.layer_id is not None else None
        if lora is None:
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.apply(self.layer_id, "gate_up_proj", x, gate_up)
        act = silu_mul(gate_up)
        out = self.down_proj(act)
        lora.apply(self.layer_id, "down_proj", act, out)
        return out

    def hf_names(self, pre: str) -> dict[str, tuple[nn.Parameter, int, int]]:
        """HF name -> (parameter, first row, rows); ``pre`` ends with the MLP's dot."""
        table: dict[str, tuple[nn.Parameter, int, int]] = {}
        for kind in ("weight", "bias", "weight_scale"):
            fused = getattr(self.gate_up_proj, kind, None)
            if fused is not None:
                for shard, proj in enumerate(("gate_proj", "up_proj")):
                    table[f"{pre}{proj}.{kind}"] = (fused, self.gate_up_proj.shard_offset(shard),
                                                    self.gate_up_proj.shard_sizes[shard])
            p = getattr(self.down_proj, kind, None)
            if p is not None:
                table[f"{pre}down_proj.{kind}"] = (p, 0, p.shape[0])
        return table
