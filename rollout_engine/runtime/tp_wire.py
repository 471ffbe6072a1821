"""What rank 0 and the other ranks say to each other over their pipes (not the collectives).

    rank 0 -> rank r   b"F" + one int64 array: a forward's inputs (every step)
                       b"C" + a pickled op: ControlOp, Verdict, StopOp
    rank r -> rank 0   pickled: Ready, Prepared, Final, Crashed

A forward's array is the ForwardBatch's tensors back to back, plus the whole KV-slot rows
``[0, seq_len)`` of the requests ``full`` names (their rows of the request-to-token table): a
request being extended (a matched prefix's slots were written on rank 0 at admission), and one
extended last time (inserting it into the radix tree may have swapped its slots for the tree's
copies). Every other row only gains this step's slot, its ``out_cache_loc``.

    | mode T B N F R | input_ids positions out_cache_loc (T each) | req_pool_indices seq_lens
    | prefix_lens extend_lens (B each) | logits_indices (N) | full (F) | their rows (R) |
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from rollout_engine.models.forward_batch import ForwardBatch, ForwardMode

__all__ = ["ControlOp", "Crashed", "Final", "Prepared", "Ready", "StopOp", "Verdict",
           "decode_forward", "encode_forward", "encode_op"]

FORWARD, OP = b"F", b"C"
_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)


@dataclass
class ControlOp:
    """Run control call ``method`` (a mirror of rank 0's) on this rank's shard."""

    call_id: int
    method: str
    kwargs: dict[str, Any]


@dataclass
class Verdict:
    """Rank 0's decision on a weight update every rank has checked (``Prepared``)."""

    call_id: int
    ok: bool
    message: str = ""


@dataclass
class StopOp:
    pass


@dataclass
class Ready:
    rank: int
    pid: int
    max_total_num_tokens: int
    call_id: int = -1   # not a call's answer


@dataclass
class Prepared:
    """A rank checked its part of update ``call_id``: ``error`` says why it cannot apply it."""

    call_id: int
    error: Optional[str]


@dataclass
class Final:
    """A rank's answer to a ControlOp."""

    call_id: int
    ok: bool
    result: Any = None
    message: str = ""
    status: int = 500
    fatal: bool = False    # its weights may now differ from the others' (a failed write)


@dataclass
class Crashed:
    rank: int
    message: str = field(default="")


def encode_op(op: Any) -> bytes:
    return OP + pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL)


def encode_forward(fb: ForwardBatch, table: torch.Tensor, full: list[int]) -> bytes:
    """One forward's inputs (``table``: rank 0's request-to-token table; ``full``: the batch
    indices whose whole rows go too)."""
    idx = fb.req_pool_indices.tolist()
    rows = np.empty(0, dtype=np.int64)
    if full:
        rows = torch.cat([table[idx[b], :fb.seq_lens_list[b]] for b in full]).cpu().numpy()
    parts = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
             fb.prefix_lens, fb.extend_lens, fb.logits_indices]
    arrays = [t.cpu().numpy().astype(np.int64, copy=False) for t in parts]
    head = np.array([_MODES.index(fb.mode), arrays[0].size, arrays[3].size, arrays[7].size,
                     len(full), rows.size], dtype=np.int64)
    return FORWARD + np.concatenate([head, *arrays, np.array(full, dtype=np.int64),
                                     rows.astype(np.int64, copy=False)]).tobytes()


def decode_forward(data: bytes, device: torch.device, table: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch of ``data`` (after its tag byte), with its slots written into this
    rank's ``table``."""
    flat = torch.from_numpy(np.frombuffer(data, dtype=np.int64, offset=1).copy())
    mode, t, b, n, f, r = flat[:6].tolist()
    sizes = [t, t, t, b, b, b, b, n, f, r]
    pieces = list(torch.split(flat[6:], sizes))
    full, rows = pieces[8].tolist(), pieces[9].to(device)
    ids, pos, loc, pool_idx, seq, prefix, ext, logits_idx = (p.to(device) for p in pieces[:8])
    seq_list, prefix_list, ext_list = seq.tolist(), prefix.tolist(), ext.tolist()
    pool_list, start = pool_idx.tolist(), 0
    for i in full:
        table[pool_list[i], :seq_list[i]] = rows[start:start + seq_list[i]]
        start += seq_list[i]
    if _MODES[mode] == ForwardMode.DECODE:   # the new tokens' slots
        table[pool_idx, seq - 1] = loc
    return ForwardBatch(mode=_MODES[mode], input_ids=ids, positions=pos, out_cache_loc=loc,
                        req_pool_indices=pool_idx, seq_lens=seq, prefix_lens=prefix,
                        extend_lens=ext, logits_indices=logits_idx, seq_lens_list=seq_list,
                        prefix_lens_list=prefix_list, extend_lens_list=ext_list)
