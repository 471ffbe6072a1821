"""The sender's cache of serialized (name, tensor) lists (`payload_cache.SentPayloads`): a repeat
of the same views of the same storages is the same string without pickling, lent again (a
receiver in another process maps it, taking and dropping no reference of the sender's), and
anything else that changed is serialized afresh."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_engine.protocol import payload_sender
from rollout_engine.protocol.payload_cache import SentPayloads
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.protocol.tensor_handles import SHM_DIR
from rollout_engine.protocol.tensor_payload import deserialize_named_tensors


@pytest.fixture
def dumps(monkeypatch):
    """Counts the pickler's runs, with a fresh cache."""
    count = []
    real = payload_sender.ForkingPickler

    class Counting(real):  # type: ignore[misc, valid-type]
        def dump(self, obj):
            count.append(1)
            return super().dump(obj)

    monkeypatch.setattr(payload_sender, "ForkingPickler", Counting)
    monkeypatch.setattr(payload_sender, "_SENT", SentPayloads())
    return count


def _shm_path(t: torch.Tensor) -> str:
    _, handle, _ = t.untyped_storage()._share_filename_cpu_()
    return os.path.join(SHM_DIR, handle.decode()[1:])


def _reader(conn) -> None:
    """Another process: open each payload, report its sums, drop it (closing the mapping)."""
    while True:
        text = conn.recv()
        if text is None:
            return
        named = deserialize_named_tensors(text)
        sums = [float(t.sum()) for _, t in named]
        del named
        gc.collect()   # unmapped before answering: the answer says this process let go
        conn.send(sums)


@contextlib.contextmanager
def _reader_process(target=None):
    """A reader in another process (`_reader` by default); its end of the pipe. Told to stop
    and joined (exit code 0 asserted) on the way out; killed if it will not."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target or _reader, args=(child,), daemon=True)
    proc.start()
    try:
        yield parent
        parent.send(None)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_repeats_are_one_pickling_and_keep_the_shm_references_balanced(dumps):
    weights = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3)), ("tied", None)]
    weights[2] = ("tied", weights[0][1])   # two names, one storage: one handle
    with _reader_process() as parent:
        texts = []
        for step in range(4):
            weights[0][1].add_(1.0)                 # an optimizer step, in place
            texts.append(serialize_named_tensors(weights))
            parent.send(texts[-1])
            assert parent.poll(60), "the reader did not answer"
            expected = [float(t.sum()) for _, t in weights]
            assert parent.recv() == expected, step
        assert len(dumps) == 1 and len(set(texts)) == 1
        paths = {_shm_path(t) for _, t in weights}
        assert len(paths) == 2
        # the reader opened and closed the files four times: a reference dropped by a read
        # would have taken them to zero (unlinked) under the live sender
        assert all(os.path.exists(p) for p in paths)
    weights.clear()
    gc.collect()
    # ... and one too many would keep them after the sender let go
    assert not any(os.path.exists(p) for p in paths)


def test_any_change_in_what_is_sent_is_serialized_again(dumps):
    a, b = torch.zeros(8), torch.ones(4)
    first = serialize_named_tensors([("a", a), ("b", b)])
    variants = [
        [("a", a), ("c", b)],                     # another name
        [("a", a[:4]), ("b", b)],                 # another view of the same storage
        [("a", a.view(2, 4)), ("b", b)],          # another shape
        [("a", a), ("b", b.clone())],             # another storage
        [("a", torch.nn.Parameter(a)), ("b", b)],  # another class
        [("a", a), ("b", b), ("a2", a)],          # more entries
    ]
    texts = [serialize_named_tensors(v) for v in variants]
    assert len(dumps) == 1 + len(variants)
    assert len({first, *texts}) == 1 + len(variants)
    for variant, text in zip(variants, texts):
        got = deserialize_named_tensors(text)
        assert [n for n, _ in got] == [n for n, _ in variant]
        assert all(torch.equal(g, t) and g.shape == t.shape
                   for (_, g), (_, t) in zip(got, variant))


def test_a_freed_storage_is_never_mistaken_for_a_new_one_at_its_address():
    """The key holds a storage's address; one freed and another allocated there has the same
    key, and only the string's weak references tell them apart."""
    cache = SentPayloads()
    old = torch.full((1024,), 3.0)
    key = SentPayloads.key([("w", old)])
    cache.put(key, "text", [old.untyped_storage()])
    text, storages = cache.get(key)
    assert text == "text" and storages[0].data_ptr() == old.data_ptr()
    del old, storages
    gc.collect()
    assert cache.get(key) is None   # as a new storage at the same address would look it up


def test_other_payloads_are_not_kept():
    assert SentPayloads.key({"w": torch.zeros(2)}) is None
    assert SentPayloads.key([("w", 3)]) is None
    assert SentPayloads.key([]) is None
    assert SentPayloads.key([("w", torch.zeros(2), 1)]) is None


def test_views_of_one_storage_drop_one_reference_per_read(dumps):
    """Two names viewing one storage (a fused projection sent as its q / k / v slices): the
    reader maps the storage once a read and drops no reference for any view (a drop per view
    unlinked the file under the live sender and the second refit failed: "does not exist")."""
    fused = torch.arange(12.0)
    weights = [("q", fused[:6]), ("k", fused[6:9]), ("v", fused[9:])]
    with _reader_process() as parent:
        for step in range(4):
            fused.add_(1.0)
            parent.send(serialize_named_tensors(weights))
            assert parent.poll(60), "the reader did not answer"
            answer = parent.recv()
            assert answer == [float(t.sum()) for _, t in weights], (step, answer)
        path = _shm_path(fused)
        assert os.path.exists(path)
    weights.clear()
    del fused
    gc.collect()
    assert not os.path.exists(path)   # and no reference is left over either


@pytest.fixture(scope="module")
def reader():
    """One reader process for many payloads (`_reader`)."""
    with _reader_process() as parent:
        yield parent


_VIEWS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(1, 40),
                            st.booleans()), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(views=_VIEWS, sends=st.integers(1, 3))
def test_any_views_of_any_storages_keep_the_shm_references_balanced(reader, views, sends):
    """Random views (offset, length; some the very same tensor under a second name) of up to
    three storages, sent `sends` times to another process that opens and drops each payload:
    every read sees the current values, the files live while the sender holds the storages,
    and none is left once it lets go (an extra drop unlinks early, a missing one leaks)."""
    storages = [torch.arange(100.0) + 1000 * i for i in range(3)]
    named: list[tuple[str, torch.Tensor]] = []
    for i, (which, start, length, again) in enumerate(views):
        if again and named:
            named.append((f"w{i}", named[-1][1]))   # the same tensor, another name
        else:
            named.append((f"w{i}", storages[which][start:start + length]))
    for step in range(sends):
        torch._foreach_add_(storages, 1.0)   # an optimizer step (no loop variable left holding one)
        reader.send(serialize_named_tensors(named))
        assert reader.poll(60), "the reader did not answer"
        assert reader.recv() == [float(t.sum()) for _, t in named], step
    used = {id(t.untyped_storage()._cdata): t for _, t in named}
    paths = {_shm_path(t) for t in used.values()}
    assert all(os.path.exists(p) for p in paths)
    named.clear()
    used.clear()
    storages.clear()
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)


def _rank_reader(conn) -> None:
    """`_reader`, for (payload, deserialize keyword arguments) pairs (a tensor-parallel rank)."""
    while True:
        item = conn.recv()
        if item is None:
            return
        text, kwargs = item
        named = deserialize_named_tensors(text, **kwargs)
        sums = [float(t.sum()) for _, t in named]
        del named
        gc.collect()
        conn.send(sums)


def test_two_ranks_reading_one_payload_drop_each_reference_once():
    """One payload for both ranks of a TP=2 engine (rank 1 reads it `read_by_others`, as the
    worker does), its tensors in verl's LocalSerializedTensor with a value pickled for each
    rank (SGLang: one per rank; two pickles of one tensor are the same bytes): each rank drops
    its own value's references, the outer payload's flag notwithstanding. Across repeats the
    files live while the sender holds the tensors, and none is left after (passing the flag
    into the values leaked them)."""
    from tests.rollout_engine.compat.sglang_fakes import (
        LocalSerializedTensor,
        file_system_sharing,
        mp_serialize,
        sglang_modules,
    )

    weight = torch.arange(8.0)
    with _reader_process(_rank_reader) as rank0, _reader_process(_rank_reader) as rank1:
        pipes = [rank0, rank1]
        with file_system_sharing(), sglang_modules():
            for step in range(3):
                weight.add_(1.0)
                values = [mp_serialize(weight) for _ in range(2)]   # one per rank
                text = mp_serialize([("w", LocalSerializedTensor(values=values))],
                                    output_str=True)
                for rank, pipe in enumerate(pipes):
                    pipe.send((text, {"tp_rank": rank, "read_by_others": rank > 0}))
                for pipe in pipes:
                    assert pipe.poll(60), "a reader did not answer"
                    assert pipe.recv() == [float(weight.sum())], step
        path = _shm_path(weight)
        assert os.path.exists(path)
    del weight
    gc.collect()
    assert not os.path.exists(path)
