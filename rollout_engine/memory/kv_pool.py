"""The token-to-KV pool: per-layer K and V tensors indexed by slot, and a page allocator.

A token's KV lives at one slot of every layer's buffers. Slots are handed out in pages of
``page_size`` consecutive, page-aligned slots; a page is always wholly free, owned by one request,
or held by the prefix cache (the invariant ``check_integrity`` proves with the scheduler's help).

    slot:  0 1 2 3 | 4 5 6 7 | 8 9 10 11      (page_size 4)
    page:     0    |    1    |     2
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_engine.host_lists import list_tensor
from rollout_engine.memory import huge_pages


class KVPool:
    """Per-layer K/V buffers ``[num_slots + 1, num_kv_heads, head_dim]``.

    Slots ``[0, num_slots)`` are the allocator's. Row ``padding_slot == num_slots`` is never
    allocated and no request reads it: padded rows of a fixed-size (CUDA-graph) decode batch
    write their throw-away K/V there, so they cannot clobber a live request's slot.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.padding_slot = num_slots
        self.num_layers = num_layers
        self.shape = (num_slots + 1, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k_buffers: list[torch.Tensor] = []
        self.v_buffers: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        # Zeros, not empty: padded attention reads masked slots, and garbage NaNs would leak
        # through the mask as NaN * 0.
        # (on CPU in huge pages: a decode step reads slots all over them, memory/huge_pages.py)
        self.k_buffers = [huge_pages.zeros(self.shape, self.dtype, self.device)
                          for _ in range(self.num_layers)]
        self.v_buffers = [huge_pages.zeros(self.shape, self.dtype, self.device)
                          for _ in range(self.num_layers)]

    def release(self) -> None:
        """Drop the buffers (sleep). ``allocate`` brings them back zeroed."""
        self.k_buffers, self.v_buffers = [], []

    @property
    def is_allocated(self) -> bool:
        return bool(self.k_buffers)

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return 2 * self.num_layers * n * torch.empty((), dtype=self.dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v


class PageAllocator:
    """Free list of pages. Lowest page ids first, so runs are reproducible."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        if num_slots < page_size:
            raise ValueError(f"KV pool of {num_slots} slots is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self._free: list[int] = []
        self._free_set: set[int] = set()
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields page 0 first
        self._free_set = set(self._free)

    def rewind(self) -> bool:
        """When every page is free, hand them out from page 0 again (True) instead of in the
        order they came back: a flushed pool's pages return request by request, so without
        this the next prompts' keys land scattered across the pool instead of consecutive.
        False (nothing changed)
        while any page is taken."""
        if len(self._free) != self.num_pages:
            return False
        self.reset()
        return True

    def available_size(self) -> int:
        """Free slots."""
        return len(self._free) * self.page_size

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> Optional[list[int]]:
        """Slots of ``num_pages`` fresh pages, or None (nothing taken) when short."""
        if num_pages > len(self._free):
            return None
        cut = len(self._free) - num_pages
        pages = self._free[cut:][::-1]          # the order pop() would give them in
        del self._free[cut:]
        self._free_set.difference_update(pages)
        ps = self.page_size
        return pages if ps == 1 else [s for p in pages for s in range(p * ps, p * ps + ps)]

    def free(self, slots: torch.Tensor | list[int]) -> None:
        """Return whole pages given by their slots (every slot of each page, page-aligned)."""
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        ps = self.page_size
        if len(values) % ps:
            raise ValueError(f"free of {len(values)} slots is not whole pages of {ps}")
        for i in range(0, len(values), ps):
            first = values[i]
            if first % ps:
                raise ValueError(f"slot {first} is not page-aligned (page_size {ps})")
            page = first // ps
            if page in self._free_set or not 0 <= page < self.num_pages:
                raise ValueError(f"double free or bad page {page}")
            self._free.append(page)
            self._free_set.add(page)

    def free_pages(self) -> set[int]:
        return set(self._free_set)


def row_width(context_len: int, page_size: int) -> int:
    """Columns a request-table row needs: whole pages covering ``context_len`` positions.

    A request never holds more than ``context_len`` tokens, but its slots come in whole pages
    (a prompt's pages, a chunk's, a decode run's), so the row must take the context's last page
    whole::

        context_len 100, page_size 16:  positions 0..99 | last page 96..111  -> 112 columns
    """
    return -(-context_len // page_size) * page_size


class ReqToTokenPool:
    """Rows of slot indices, one row per running request: ``table[row, position] = slot``.

    Writes are gathered and land in one ``index_put_`` when ``table`` is next read: a decode
    step writes one slot for each of hundreds of requests, and a tensor op apiece (~8 us) was
    ~2 ms of every step at batch 256.

    ``generation`` counts the changes to slots already written (a row given to a new request,
    a prefix rewritten with the cache's slots); appending past a row's end, as every decode
    step does, leaves it as it is, so whatever was derived from the rows' existing slots (the
    decode kernel's shared-prefix plan) stays valid while it is unchanged."""

    def __init__(self, max_num_reqs: int, max_context_len: int, device: torch.device) -> None:
        self._table = torch.zeros((max_num_reqs, max_context_len), dtype=torch.int64,
                                  device=device)
        self._free = list(range(max_num_reqs - 1, -1, -1))
        self.size = max_num_reqs
        self.generation = 0
        self._ends = [0] * max_num_reqs   # per row: the end of what has been written
        self._rows: list[int] = []       # pending writes, flattened: table[row, col] = slot
        self._cols: list[int] = []
        self._slots: list[int] = []

    @property
    def table(self) -> torch.Tensor:
        """The table, every write so far applied."""
        if self._slots:
            flat = (list_tensor(self._rows) * self._table.shape[1] + list_tensor(self._cols))
            values = list_tensor(self._slots)
            positions = torch.unique(flat)
            if positions.numel() < flat.numel():   # a position written twice: the last wins
                last = torch.full_like(positions, -1).scatter_reduce_(
                    0, torch.searchsorted(positions, flat), torch.arange(flat.numel()), "amax")
                flat, values = flat[last], values[last]
            dev = self._table.device
            self._table.view(-1)[flat.to(dev)] = values.to(dev)
            self._rows, self._cols, self._slots = [], [], []
        return self._table

    def available_size(self) -> int:
        return len(self._free)

    def allocate(self) -> Optional[int]:
        if not self._free:
            return None
        row = self._free.pop()
        self._ends[row] = 0
        self.generation += 1
        return row

    def free(self, row: int) -> None:
        if row in self._free:
            raise ValueError(f"req_to_token row {row} freed twice")
        self._free.append(row)

    def write_many(self, rows: list[int], starts: list[int], widths: list[int],
                   slots: list[int]) -> None:
        """``write(rows[i], starts[i], the next widths[i] of slots)`` for each i, in one pass
        (a decode step's new pages, one run per request)."""
        if len(slots) != sum(widths):
            raise ValueError(f"write_many: {len(slots)} slots for runs of {sum(widths)}")
        for row, start, width in zip(rows, starts, widths):
            self._claim(row, start, start + width)
        self._slots.extend(slots)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        """``table[row, start:start + len(slots)] = slots`` (applied at the next read)."""
        if not slots:
            return
        self._claim(row, start, start + len(slots))
        self._slots.extend(slots)

    def _claim(self, row: int, start: int, end: int) -> None:
        """Queue positions ``[start, end)`` of ``row`` for the next write (their slots follow
        in ``_slots``); a write below the row's end changes slots already there."""
        if not (0 <= row < self.size and 0 <= start and end <= self._table.shape[1]):
            raise IndexError(f"req_to_token write [{row}, {start}:{end}] outside the table "
                             f"{tuple(self._table.shape)}")
        if start < self._ends[row]:
            self.generation += 1
        self._ends[row] = max(self._ends[row], end)
        self._rows.extend([row] * (end - start))
        self._cols.extend(range(start, end))
