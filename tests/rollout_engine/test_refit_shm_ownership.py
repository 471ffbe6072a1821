"""Who owns the shared memory behind a tensor refit: whatever the engine answers (applied,
refused while asleep, cancelled by its deadline, refused as malformed) and whatever happens to
the trainer (killed before or after the engine read its payload), no shm file of the sender is
left in /dev/shm once the sender lets go of its tensors, and no torch_shm_manager outlives its
trainer.

Files are counted by the creating process's pid in their name (``torch_<pid>_...``), so other
processes' shared memory on the machine does not disturb the counts."""

from __future__ import annotations

import gc
import glob
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.weights.loader import iter_safetensors

NORM = "model.norm.weight"


def shm_files(pid: int) -> set[str]:
    """The torch shared-memory files process `pid` created that still have a name."""
    return set(glob.glob(f"/dev/shm/torch_{pid}_*"))


def wait_until(condition: Any, timeout: float = 20.0) -> bool:
    """Poll `condition()` until true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def model_path() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2"))


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Any]:
    from tests.rollout_engine.engines import thread_engine

    yield from thread_engine(model_path)


@pytest.fixture
def norm(model_path: str) -> torch.Tensor:
    return dict(iter_safetensors(model_path))[NORM]


def _leftover(before: set[str]) -> set[str]:
    gc.collect()
    return shm_files(os.getpid()) - before


@pytest.mark.parametrize("sender", ["ours", "torch's reducer"])
def test_a_refit_refused_while_asleep_leaves_no_shared_memory(engine, model_path, norm, sender):
    """Our sender lends its memory and lets go after the answer; a payload pickled by torch's
    own reducer (SGLang's serializer) carries a reference for its reader, which the refusal
    drops as a read would have."""
    from tests.rollout_engine.compat.sglang_fakes import file_system_sharing, mp_serialize

    before = shm_files(os.getpid())
    engine.release_memory_occupation(["weights"])
    try:
        weights = [(NORM, norm.clone())]
        if sender == "ours":
            ok, message = engine.update_weights_from_tensor(weights)
        else:
            with file_system_sharing():
                text = mp_serialize(weights, output_str=True)
            ok, message = engine.update_weights_from_tensor([text])
        assert not ok and "released" in message, message
        del weights
    finally:
        engine.resume_memory_occupation(["weights"])
        assert engine.update_weights_from_disk(model_path, weight_version="w1")[0]
    assert _leftover(before) == set()


@pytest.mark.parametrize("sender", ["ours", "torch's reducer"])
def test_a_refit_cancelled_by_its_deadline_leaves_no_shared_memory(engine, norm, sender):
    from tests.rollout_engine.compat.sglang_fakes import file_system_sharing, mp_serialize

    before = shm_files(os.getpid())
    cancelled = engine.tm.control.stats["cancelled_after_timeout"]
    weights = [(NORM, norm.clone())]
    if sender == "ours":
        text = serialize_named_tensors(weights)
    else:
        with file_system_sharing():
            text = mp_serialize(weights, output_str=True)
    assert shm_files(os.getpid()) - before   # the tensor lives in shared memory now
    # a deadline already past when the scheduler takes the call: cancelled, never read
    result = engine.tm.call("update_weights_from_tensor", timeout=-1.0,
                            serialized_named_tensors=[text])
    assert result.status == 504
    assert wait_until(lambda: engine.tm.control.stats["cancelled_after_timeout"] > cancelled)
    del weights
    assert _leftover(before) == set()


@pytest.mark.parametrize("case", ["refused global", "refused flag"])
def test_a_malformed_refit_leaves_no_shared_memory(engine, norm, case):
    """Refused with a 400 before (or without ever) opening a handle the payload names."""
    before = shm_files(os.getpid())
    if case == "refused global":
        ok, message = engine.update_weights_from_tensor([(NORM, norm.clone()), ("hook", print)])
    else:
        ok, message = engine.update_weights_from_tensor([(NORM, norm.clone())], pp_rank=3)
    assert not ok, message
    assert _leftover(before) == set()


def test_a_payload_for_a_rank_the_engine_lacks_leaves_no_shared_memory(engine, norm):
    """One payload per tensor-parallel rank: this engine has one rank and reads the first; the
    second is never read, and nothing of it is left once its sender lets go."""
    read, unread = [(NORM, norm.clone())], [(NORM, norm.clone())]
    ok, message = engine.update_weights_from_tensor(
        [serialize_named_tensors(read), serialize_named_tensors(unread)])
    assert ok, message
    path = "/dev/shm" + unread[0][1].untyped_storage()._share_filename_cpu_()[1].decode()
    assert os.path.exists(path)
    del unread
    gc.collect()
    assert not os.path.exists(path)


def _trainer(conn: Any, name: str, value: torch.Tensor) -> None:
    """A trainer process: its weight in shared memory, serialized and handed over; then it
    waits to be killed."""
    weights = [(name, value.clone())]
    conn.send((os.getpid(), serialize_named_tensors(weights)))
    conn.recv()


def _shm_managers(pid: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(pid).children() if c.name() == "torch_shm_manager"]


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("when", ["after the read", "before the read"])
def test_a_killed_trainer_leaves_no_shared_memory_and_no_shm_manager(engine, norm, when):
    """The engine keeps what it read mapped (a refit's cache), but holds nothing that keeps the
    dead trainer's files named or its shm manager running."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_trainer, args=(child, NORM, norm + 1.0), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the trainer did not start"
        pid, text = parent.recv()
        managers = _shm_managers(pid)
        assert len(managers) == 1 and shm_files(pid)
        if when == "after the read":
            ok, message = engine.update_weights_from_tensor([text], weight_version="dying")
            assert ok, message
            assert engine.get_weights_by_name(NORM, 4) == (norm[:4] + 1.0).tolist()
        os.kill(pid, signal.SIGKILL)
        proc.join(30)
        if when == "before the read":
            engine.update_weights_from_tensor([text])   # applied or refused: either may be
        assert wait_until(lambda: _gone(managers[0]) and not shm_files(pid)), (
            f"left: {shm_files(pid)}, manager running: {not _gone(managers[0])}")
    finally:
        if proc.is_alive():
            proc.kill()
