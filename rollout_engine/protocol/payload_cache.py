"""The two caches of repeated tensor payloads, one on each side.

A trainer whose weights live in shared memory (where the first refit moved them) sends the very
same handles every refit: the same shm files, the same views. So the sender keeps the strings it
made (`SentPayloads`: ~10 us a tensor of pickling saved) and the receiver keeps what parsing them
gave (`ParsedPayloads`: ~50 us a tensor of restricted unpickling saved). Neither skips what
must hold each time: the sender leases the storages again, the receiver checks each storage
again and materializes afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["ParsedPayloads", "SentPayloads"]


class ParsedPayloads:
    """The descriptor trees of the last few payloads read, by their exact bytes (and the
    reader's cap, rank and depth). Only what parsing is (a pure function of the bytes) is kept:
    each storage's checks (byte budget, manager socket, shm file size) run again on every read,
    and the tree is materialized afresh."""

    SIZE = 256   # a refit of a large model in small buckets sends hundreds of payloads

    def __init__(self) -> None:
        self._trees: OrderedDict[tuple[Any, ...], tuple[Any, list[Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            hit = self._trees.get(key)
            if hit is not None:
                self._trees.move_to_end(key)
            return hit

    def put(self, key: tuple[Any, ...], tree: Any, storages: list[Any]) -> None:
        with self._lock:
            self._trees[key] = (tree, storages)
            while len(self._trees) > self.SIZE:
                self._trees.popitem(last=False)


class SentPayloads:
    """The strings of the last few (name, CPU tensor) lists serialized, by what they describe.

    A hit needs every entry to be the same name and the same view (class, dtype, offset, shape,
    stride, requires_grad) of the very same storage, alive: each string keeps a weak reference
    to the storages it names, so a storage freed and another allocated at its address is a
    miss. A storage moved into shared memory keeps its shm file for life, so the string still
    names the right files and their current contents. A hit gives the storages back (alive),
    for the sender's lease of this send.
    """

    SIZE = 256

    def __init__(self) -> None:
        self._strings: OrderedDict[tuple[Any, ...], tuple[str, list[StorageWeakRef]]] = \
            OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(payload: object) -> Optional[tuple[Any, ...]]:
        """What a string of `payload` depends on, or None for a payload this cache does not
        keep (anything but a list or tuple of (str, CPU tensor) pairs)."""
        if type(payload) not in (list, tuple) or not payload:
            return None
        parts = []
        for item in payload:   # type: ignore[union-attr]
            if type(item) not in (tuple, list) or len(item) != 2:
                return None
            name, t = item
            if type(name) is not str or not isinstance(t, torch.Tensor) or t.device.type != "cpu" \
                    or t.is_sparse or not t.is_leaf and t.requires_grad:
                return None
            parts.append((name, type(t), type(item), t.dtype, t.storage_offset(), t.shape,
                          t.stride(), t.requires_grad, t.untyped_storage()._cdata))
        return (type(payload), *parts)

    def get(self, key: tuple[Any, ...]) -> Optional[tuple[str, list[torch.UntypedStorage]]]:
        """The cached string and the storages its handles name; None on a miss."""
        with self._lock:
            hit = self._strings.get(key)
            if hit is None:
                return None
            text, refs = hit
            storages = [torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in refs]
            if any(s is None for s in storages):   # freed (no strong reference left)
                del self._strings[key]
                return None
            self._strings.move_to_end(key)
            return text, storages

    def put(self, key: tuple[Any, ...], text: str, shared: list[torch.UntypedStorage]) -> None:
        """Keep `text`; `shared`: the storages its handles name."""
        refs = [StorageWeakRef(s) for s in shared]
        with self._lock:
            self._strings[key] = (text, refs)
            while len(self._strings) > self.SIZE:
                self._strings.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._strings.clear()


def recording(reduce: Callable[[torch.UntypedStorage], Any], into: list[torch.UntypedStorage]
              ) -> Callable[[torch.UntypedStorage], Any]:
    """`reduce`, noting each storage it reduced in `into`."""
    def reduce_and_record(storage: torch.UntypedStorage) -> Any:
        out = reduce(storage)
        into.append(storage)
        return out

    return reduce_and_record
