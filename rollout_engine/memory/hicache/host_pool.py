"""The host KV tier (L2): a copy of evicted device pages in CPU memory, page-first.

Layout ``[num_slots, 2, num_layers, num_kv_heads, head_dim]``: every layer's K and V of one token
lie together, so a page (``page_size`` consecutive slots) is one contiguous run of bytes. That
is what makes a page cheap to move as a unit, to the device and to the storage tier::

    slot:    0          1          2          3       | ...   (page_size 2)
            [K0..KL V0..VL][K0..KL V0..VL] ...          one page = 2 rows, contiguous
    page:   |<------- 0 -------->|<------ 1 ------->|

On CUDA the buffer is pinned (page-locked) so copies to the device are DMA; on CPU it is plain
memory. Slots are handed out by a ``PageAllocator`` of its own: the host tier never shares slot
numbers with the device pool.
"""

from __future__ import annotations

import torch

from rollout_engine.memory.kv_pool import KVPool, PageAllocator

__all__ = ["HostKVPool", "host_pool_slots"]


def host_pool_slots(device_slots: int, page_size: int, ratio: float, size_gb: float,
                    bytes_per_token: int) -> int:
    """Host slots for ``--hicache-size`` GB (when > 0) or ``--hicache-ratio`` x the device pool,
    rounded down to whole pages (at least one)."""
    if size_gb > 0:
        slots = int(size_gb * 2**30) // bytes_per_token
    else:
        slots = int(device_slots * ratio)
    slots = slots // page_size * page_size
    if slots < page_size:
        raise ValueError(f"hicache host pool of {slots} slots is smaller than one page "
                         f"({page_size}); raise hicache_ratio or hicache_size")
    return slots


class HostKVPool:
    """Host copies of KV pages, indexed by host slot; moves pages to and from a ``KVPool``."""

    def __init__(self, device_pool: KVPool, num_slots: int, page_size: int) -> None:
        self.device_pool = device_pool
        self.num_slots = num_slots
        self.page_size = page_size
        _, heads, dim = device_pool.shape
        self.row_shape = (2, device_pool.num_layers, heads, dim)
        self.dtype = device_pool.dtype
        self.pin = device_pool.device.type == "cuda"
        self.allocator = PageAllocator(num_slots, page_size)
        self.buffer = torch.empty(0, dtype=self.dtype)
        self.allocate()

    # -- memory (sleep / wake) --------------------------------------------------------------------
    def allocate(self) -> None:
        """Allocate and touch the buffer, so its pages are resident from the start (what a
        release must give back is then exactly ``nbytes``)."""
        self.buffer = torch.empty((self.num_slots, *self.row_shape), dtype=self.dtype,
                                  pin_memory=self.pin)
        self.buffer.zero_()
        self.allocator.reset()

    def release(self) -> None:
        """Drop the buffer (sleep with ``kv_cache``); every host slot is free afterwards."""
        self.buffer = torch.empty(0, dtype=self.dtype)
        self.allocator.reset()

    @property
    def is_allocated(self) -> bool:
        return self.buffer.numel() > 0

    def nbytes(self) -> int:
        n = self.num_slots
        for d in self.row_shape:
            n *= d
        return n * self.buffer.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes() // self.num_slots

    # -- copies ------------------------------------------------------------------------------------
    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Copy the device pool's KV at ``device_slots`` into ``host_slots``; returns bytes."""
        pool = self.device_pool
        if pool.device.type == "cpu":
            # straight into each layer's (strided) view of the host rows: one gather and one
            # scatter per layer and K/V, no stacked intermediate (2-3x faster on CPU)
            for i in range(pool.num_layers):
                self.buffer[:, 0, i].index_copy_(0, host_slots,
                                                 pool.k_buffers[i].index_select(0, device_slots))
                self.buffer[:, 1, i].index_copy_(0, host_slots,
                                                 pool.v_buffers[i].index_select(0, device_slots))
            return host_slots.numel() * self.bytes_per_token
        dev = device_slots.to(pool.device)
        k = torch.stack([pool.k_buffers[i][dev] for i in range(pool.num_layers)], dim=1)
        v = torch.stack([pool.v_buffers[i][dev] for i in range(pool.num_layers)], dim=1)
        rows = torch.stack([k, v], dim=1).to("cpu", non_blocking=False)
        self.buffer.index_copy_(0, host_slots, rows)
        return rows.numel() * rows.element_size()

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> int:
        """Copy ``host_slots`` into the device pool at ``device_slots``; returns bytes."""
        pool = self.device_pool
        if pool.device.type == "cpu":
            # per layer and K/V, gather from the host rows' strided view and scatter into the
            # pool: no [N, 2, L, H, D] intermediate (2-3x faster on CPU for thousands of rows)
            for i in range(pool.num_layers):
                pool.k_buffers[i].index_copy_(0, device_slots,
                                              self.buffer[:, 0, i].index_select(0, host_slots))
                pool.v_buffers[i].index_copy_(0, device_slots,
                                              self.buffer[:, 1, i].index_select(0, host_slots))
            return host_slots.numel() * self.bytes_per_token
        # one gather (into pinned memory on CUDA), one copy, then a scatter per layer there
        rows = self.buffer.index_select(0, host_slots)
        if self.pin:
            rows = rows.pin_memory()
        rows = rows.to(pool.device, non_blocking=self.pin)
        dev = device_slots.to(pool.device)
        for i in range(pool.num_layers):
            pool.k_buffers[i].index_copy_(0, dev, rows[:, 0, i])
            pool.v_buffers[i].index_copy_(0, dev, rows[:, 1, i])
        return rows.numel() * rows.element_size()

    def read_rows(self, host_slots: torch.Tensor) -> bytes:
        """The raw bytes of ``host_slots`` in order (a storage block)."""
        rows = self.buffer.index_select(0, host_slots)
        return rows.view(torch.uint8).numpy().tobytes()

    def write_rows(self, host_slots: torch.Tensor, data: bytes, skip_rows: int = 0) -> None:
        """Write a storage block's bytes into ``host_slots``, dropping its first ``skip_rows``
        rows (the part of the block the tree already holds)."""
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = flat.view(self.dtype).view(-1, *self.row_shape)[skip_rows:]
        if rows.shape[0] != host_slots.numel():
            raise ValueError(f"storage block holds {rows.shape[0]} rows after the skip, "
                             f"{host_slots.numel()} host slots given")
        self.buffer.index_copy_(0, host_slots, rows)
