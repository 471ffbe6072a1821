"""Large byte copies with streaming stores (``stream_copy.cpp``), for `byte_copy.copy_all`.

Compiled at first use like every CPU kernel (``build``, cached under
``$ROLLOUT_ENGINE_CACHE/torch_extensions``). If it cannot be built, or
``ROLLOUT_ENGINE_STREAM_COPY=0``, `load_stream_copy` logs one warning (none when turned off)
and returns None, and copies stay numpy's memcpy.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import numpy as np
from rollout_engine_kernels.cpu import build

SOURCE = Path(__file__).resolve().parent / "stream_copy.cpp"
STREAM_COPY_ENV = "ROLLOUT_ENGINE_STREAM_COPY"


class StreamCopy:
    """The compiled copy: ``copy(dst_address, src_address, nbytes)`` over raw addresses (the
    caller owns both ranges; ctypes releases the GIL while it runs), and `copy_ranges`, many
    ranges shared with the library's own helper threads."""

    ABI = 2

    def __init__(self, library_path: str) -> None:
        lib = build.open_library(library_path, "rollout_engine_stream_copy_abi", self.ABI)
        self.streams = bool(lib.rollout_engine_stream_copy_streams())
        fn = lib.rollout_engine_stream_copy
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self.copy = fn
        ranges = lib.rollout_engine_copy_ranges
        ranges.restype = ctypes.c_int
        ranges.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
        self._ranges = ranges

    def copy_ranges(self, dsts: list[int], srcs: list[int], nbytes: list[int],
                    piece_bytes: int, threads: int, stream: bool = True) -> None:
        """``dsts[i] <- srcs[i]`` for ``nbytes[i]`` bytes each (raw addresses the caller owns;
        no two overlap), in pieces of at most ``piece_bytes`` taken by this thread and up to
        ``threads - 1`` helper threads of the library's; streaming stores if ``stream``. A
        helper busy with another caller's copy is not waited for."""
        self.copy_prepared(self.ranges(dsts, srcs, nbytes), piece_bytes, threads, stream)

    @staticmethod
    def ranges(dsts: list[int], srcs: list[int], nbytes: list[int]) -> tuple[np.ndarray, ...]:
        """`copy_ranges`' ranges as the library reads them (checked), for `copy_prepared`."""
        if not len(dsts) == len(srcs) == len(nbytes):
            raise ValueError("copy_ranges: dsts, srcs and nbytes must have one entry per range")
        if any(n < 0 for n in nbytes):
            raise ValueError("copy_ranges: negative size")
        return tuple(np.asarray(v, dtype=np.int64) for v in (dsts, srcs, nbytes))

    def copy_prepared(self, ranges: tuple[np.ndarray, ...], piece_bytes: int, threads: int,
                      stream: bool = True) -> None:
        """`copy_ranges` of ranges made by `ranges` (the same ones may be copied again)."""
        if piece_bytes <= 0 or threads < 1:
            raise ValueError("copy_ranges: no piece size / thread")
        self._ranges(*(a.ctypes.data for a in ranges), len(ranges[0]), piece_bytes, threads,
                     int(stream))


@functools.cache
def load_stream_copy() -> Optional[StreamCopy]:
    """The compiled copy, or None (after one warning) when it cannot be built."""
    return build.load_or_warn(
        lambda: StreamCopy(build.build_library(SOURCE, "rollout_engine_stream_copy")),
        "streaming copy", "copies use numpy's memcpy", STREAM_COPY_ENV)
