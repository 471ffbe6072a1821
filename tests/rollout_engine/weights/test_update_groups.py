"""Receiving a trainer's broadcast over a real gloo group (the trainer is rank 0 in a thread of
this process): a ``flattened_bucket`` arrives exactly as sent, whatever its tensors' byte
offsets, and lands in an engine's weights bit for bit."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from rollout_engine.protocol.weight_broadcast import flatten, join_update_group
from rollout_engine.weights.update_groups import WeightUpdateGroups

GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPT = [5, 6, 7, 8, 9, 10]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def groups() -> Any:
    """(engine side, trainer side) of one gloo group joined in two threads."""
    port, name = _free_port(), "unit-group"
    engine_side = WeightUpdateGroups(torch.device("cpu"))
    future = engine_side.start_init("127.0.0.1", port, 1, 2, name, "gloo", 60)
    trainer = join_update_group("127.0.0.1", port, 0, 2, name, "gloo", 60)
    engine_side.finish_init(name, future)
    yield engine_side, trainer, name
    engine_side.destroy(name)
    trainer.shutdown()


# sizes chosen so that later tensors start at bytes their dtypes cannot be viewed at:
#   | a: 3 x fp16 (6 B) | b: 2 x fp32 at 6 | c: 5 x int8 at 14 | d: 2x3 fp64 at 19 | ...
MIXED = [
    ("a", torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16)),
    ("b", torch.tensor([10.0, 20.0], dtype=torch.float32)),
    ("c", torch.tensor([1, -2, 3, -4, 5], dtype=torch.int8)),
    ("d", torch.arange(6, dtype=torch.float64).reshape(2, 3) / 7),
    ("e", torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=torch.bfloat16)),
    ("f", torch.empty(0, 4, dtype=torch.float32)),
    ("g", torch.tensor([123456789], dtype=torch.int64)),
]


def test_a_flattened_bucket_is_received_exactly_at_every_offset(groups):
    engine_side, trainer, name = groups
    receipt = engine_side.post([n for n, _ in MIXED], [t.dtype for _, t in MIXED],
                               [list(t.shape) for _, t in MIXED], name, "flattened_bucket")
    trainer.broadcast(flatten([t for _, t in MIXED])).wait()
    try:
        got = receipt.wait()
    finally:
        engine_side.settle(receipt)
    assert [n for n, _ in got] == [n for n, _ in MIXED]
    for (n, sent), (_, recv) in zip(MIXED, got):
        assert recv.dtype == sent.dtype and recv.shape == sent.shape, n
        assert torch.equal(_bits(recv), _bits(sent)), (n, recv, sent)


def test_a_second_bucket_does_not_show_the_first_ones_bytes(groups):
    """The staging slot is reused: a piece copied before the broadcast landed would hold the
    previous update's bytes."""
    engine_side, trainer, name = groups
    for scale in (1.0, -3.0):
        sent = [(n, (t * scale).to(t.dtype)) for n, t in MIXED]
        got = engine_side.post([n for n, _ in sent], [t.dtype for _, t in sent],
                               [list(t.shape) for _, t in sent], name, "flattened_bucket")
        trainer.broadcast(flatten([t for _, t in sent])).wait()
        try:
            received = got.wait()
        finally:
            engine_side.settle(got)
        for (n, t), (_, r) in zip(sent, received):
            assert torch.equal(_bits(r), _bits(t)), (scale, n)


# -- into an engine ----------------------------------------------------------------------------
# head_dim 12 and one kv head: a k_proj bias is 12 elements, so a 1-byte tensor of it shifts
# the next tensor off an 8-byte boundary
ODD_DIMS = {"hidden_size": 48, "num_heads": 4, "num_kv_heads": 1, "intermediate_size": 96}
KINDS = [torch.float8_e4m3fn, torch.float64, torch.bfloat16, torch.float16, torch.float32]


def _engine_weights(engine: Any, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(engine.get_weights_by_name(n, truncate_size=1024),
                            dtype=torch.float32) for n in names}


def test_a_mixed_dtype_bucket_refits_an_engine_exactly(make_engine, tmp_path):
    from safetensors.torch import save_file

    from rollout_engine.protocol.weight_broadcast import flat_layout
    from rollout_engine.testing.tiny_model import tiny_model_path
    from rollout_engine.weights.loader import iter_safetensors

    base = tiny_model_path("qwen2", **ODD_DIMS)
    new = dict(iter_safetensors(str(tiny_model_path("qwen2", seed=1, **ODD_DIMS))))
    biases = sorted(n for n in new if n.endswith("k_proj.bias"))
    order = biases + sorted(n for n in new if n not in biases)
    sent = [(n, new[n].to(KINDS[i % len(KINDS)])) for i, n in enumerate(order)]
    ranges, _ = flat_layout([t.dtype for _, t in sent], [t.shape for _, t in sent])
    assert any(start % t.dtype.itemsize for (start, _), (_, t) in zip(ranges, sent))

    engine = make_engine(str(base))
    port, name = _free_port(), "engine-bucket"
    box: dict[str, Any] = {}
    joiner = threading.Thread(target=lambda: box.update(init=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name=name, backend="gloo")))
    joiner.start()
    trainer = join_update_group("127.0.0.1", port, 0, 2, name, "gloo", 60)
    joiner.join()
    assert box["init"][0], box
    receiver = threading.Thread(target=lambda: box.update(upd=engine.update_weights_from_distributed(
        [n for n, _ in sent], [t.dtype for _, t in sent], [list(t.shape) for _, t in sent],
        group_name=name, load_format="flattened_bucket")))
    receiver.start()
    # the engine's receive is posted before a byte is sent
    deadline = time.monotonic() + 30
    while engine.get_server_info()["weight_updates_receiving"] != 1:
        assert time.monotonic() < deadline, "the engine never posted its receive"
    trainer.broadcast(flatten([t for _, t in sent])).wait()
    receiver.join()
    assert engine.destroy_weights_update_group(name)[0]
    trainer.shutdown()
    assert box["upd"][0], box["upd"]

    got = _engine_weights(engine, order)
    for n, t in sent:
        assert torch.equal(got[n].view(torch.int32), t.float().view(torch.int32)), n

    # an engine started from a checkpoint of the same weights generates the same tokens
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (ckpt / f.name).write_bytes(f.read_bytes())
    save_file({n: t.float() for n, t in sent}, str(ckpt / "model.safetensors"))
    loaded = make_engine(str(ckpt))
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert out == loaded.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
