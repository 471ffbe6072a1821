"""A refit from a safetensors checkpoint, read straight into the parameters.

    headers of every shard -> validate all (names, shapes, dtypes, byte ranges in the file)
      -> jobs: (destination bytes in a parameter, file, offset), split into <= 16 MB pieces
      -> a few threads: os.preadv(file, destination)   (one kernel copy, page cache -> param)
                        or, when the dtype is cast or the destination is not contiguous, a
                        copy_ from the file's mmap (the cast fused into that copy)

Nothing is written before every shard has been checked, so a bad or truncated checkpoint
changes no weight. A read that fails once writing has begun (an I/O error, a file truncated
by someone else meanwhile) raises `PartialLoadError` naming the weights it may have touched;
the caller must treat those as unwritten. Reads release the GIL, so the threads run in
parallel (shards and pieces of one shard alike).

safetensors' layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}``, then the
data; offsets count from the end of the header.

With tensor parallelism a rank reads only its slice of each sharded tensor: a slice of rows is
one byte range of the file (read directly), a slice of columns is copied from the mapping.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from rollout_engine.models import weight_writes
from rollout_engine.parallel.context import Shard
from rollout_engine.protocol.byte_copy import copy_into
from rollout_engine.weights.loader import (
    WeightLoadReport,
    agreed,
    iter_safetensors,
    load_weights,
    plan_targets,
    quantizer,
    safetensors_files,
)

__all__ = ["PartialLoadError", "load_checkpoint"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
PIECE_BYTES = 16 << 20      # jobs are split so the threads share big tensors too
MAX_HEADER_BYTES = 100 << 20
NUM_THREADS = max(1, min(4, os.cpu_count() or 1))


class PartialLoadError(OSError):
    """Reading failed after some parameters were already (partly) overwritten: `names`."""

    def __init__(self, message: str, names: frozenset[str]) -> None:
        super().__init__(message)
        self.names = names


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard: where its bytes are in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: str
    offset: int      # absolute, in the file
    nbytes: int


def read_header(path: str) -> Optional[list[Entry]]:
    """The entries of one shard, checked against the file's size; None when the shard uses a
    dtype this reader does not map (the caller falls back to the safetensors library)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: truncated or not a safetensors file (header of "
                             f"{header_len} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header")
    header.pop("__metadata__", None)
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry") from None
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin
                and end - begin == nbytes and min(shape, default=0) >= 0):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not "
                             f"hold a {dtype_name} tensor of shape {list(shape)}")
        if base + end > size:
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte {base + end} "
                             f"but the file has {size} bytes")
        entries.append(Entry(name, dtype, shape, path, base + begin, nbytes))
    return sorted(entries, key=lambda e: e.offset)


def load_checkpoint(model: torch.nn.Module, model_path: str) -> WeightLoadReport:
    """Refit ``model`` from the safetensors files of ``model_path`` (module docstring)."""
    parts = [read_header(path) for path in safetensors_files(model_path)]
    if any(part is None for part in parts) or quantizer(model).active:
        # an exotic dtype, or tensors a quantized model converts: the library's reader
        return load_weights(model, list(iter_safetensors(model_path)))
    entries = [e for part in parts if part is not None for e in part]
    by_name = {e.name: e for e in entries}
    with agreed(model):   # every rank checked its part before any writes
        targets = plan_targets(model, [(e.name, e.shape, e.dtype) for e in entries])
    jobs = [job for name, dst, shard in targets for job in _jobs(by_name[name], dst, shard)]
    files = _Files()
    try:
        with weight_writes.writing(), torch.no_grad():
            if NUM_THREADS == 1 or len(jobs) == 1:
                for job in jobs:
                    job.run(files)
            else:
                with ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="refit-read") as pool:
                    for future in [pool.submit(job.run, files) for job in jobs]:
                        future.result()
    except OSError as e:
        raise PartialLoadError(f"reading the checkpoint failed after writing began ({e}); "
                               "the weights it names must be written again",
                               frozenset(n for n, _, _ in targets)) from None
    finally:
        files.close()
    num_bytes = sum(dst.numel() * dst.element_size() for _, dst, _ in targets)
    num_cast = sum(by_name[n].dtype != dst.dtype for n, dst, _ in targets)
    return WeightLoadReport(num_tensors=len(targets), num_bytes=num_bytes,
                      names=frozenset(n for n, _, _ in targets), num_cast=num_cast)


class _Files:
    """Shared read-only descriptors (preadv is positionless: threads share them) and, only
    when a copy needs one, a private mapping per file."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.maps: dict[str, torch.Tensor] = {}

    def fd(self, path: str) -> int:
        if path not in self.fds:   # the GIL makes this check-and-set atomic enough: a race
            self.fds.setdefault(path, os.open(path, os.O_RDONLY))  # leaks at most one fd
        return self.fds[path]

    def mapped(self, path: str) -> torch.Tensor:
        if path not in self.maps:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.maps.setdefault(path, torch.frombuffer(mm, dtype=torch.uint8))
        return self.maps[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.maps.clear()


@dataclass(frozen=True)
class _Job:
    entry: Entry
    dst: torch.Tensor      # preadv: 1-D uint8 bytes of the parameter; copy: the typed view
    offset: int            # in the file
    direct: bool
    shard: Optional[Shard] = None   # copy: the slice of the file's tensor that goes to dst

    def run(self, files: _Files) -> None:
        if self.direct:
            view = self.dst.numpy().data
            done = 0
            while done < len(view):
                got = os.preadv(files.fd(self.entry.path), [view[done:]], self.offset + done)
                if got <= 0:
                    raise OSError(f"{self.entry.path}: file ended at byte {self.offset + done}")
                done += got
            return
        raw = files.mapped(self.entry.path)[self.offset:self.offset + self.entry.nbytes]
        if raw.storage_offset() % self.entry.dtype.itemsize:
            raw = raw.clone()   # misaligned in the file: view it from an aligned copy
        src = raw.view(self.entry.dtype).view(self.entry.shape)
        copy_into(self.dst, src if self.shard is None else self.shard.of(src))


def _jobs(entry: Entry, dst: torch.Tensor, shard: Optional[Shard] = None) -> list[_Job]:
    """Read `entry` (or its `shard`) into `dst`: straight into its bytes (pieces of <=
    PIECE_BYTES) when the dtypes match, `dst` is contiguous and the bytes are one range of the
    file (all of it, or a slice of rows), else one copy_ from the mapping."""
    if entry.nbytes == 0 or dst.numel() == 0:
        return []
    offset, nbytes = entry.offset, entry.nbytes
    if shard is not None:
        if shard.dim != 0:
            return [_Job(entry, dst, entry.offset, direct=False, shard=shard)]
        row_bytes = entry.nbytes // entry.shape[0]
        offset, nbytes = entry.offset + shard.start * row_bytes, shard.length * row_bytes
    if entry.dtype != dst.dtype or not dst.is_contiguous():
        return [_Job(entry, dst, entry.offset, direct=False, shard=shard)]
    flat = dst.reshape(-1).view(torch.uint8)
    return [_Job(entry, flat[start:start + PIECE_BYTES], offset + start, direct=True)
            for start in range(0, nbytes, PIECE_BYTES)]
