import base64
import builtins
import multiprocessing as mp
import os
import pickle
import posix
import subprocess
from collections import OrderedDict

import pytest
import torch

from rollout_engine.protocol.bucket import FlattenedBucket, TensorMeta, pack_buckets
from rollout_engine.protocol.payload_sender import serialize_named_tensors
from rollout_engine.protocol.tensor_payload import UnsafePayloadError, deserialize_named_tensors


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    return [
        ("f32", torch.randn(3, 4)),
        ("bf16", torch.randn(5).to(torch.bfloat16)),
        ("i64", torch.arange(6)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float16)),
        ("empty", torch.zeros(0, 2)),
        ("transposed", torch.randn(4, 6).t()),
    ]


def test_round_trip_in_process_shares_memory():
    tensors = _mixed_tensors()
    out = deserialize_named_tensors(serialize_named_tensors(tensors))
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (name, want), (_, got) in zip(tensors, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.stride() == want.stride() and torch.equal(_bits(got), _bits(want)), name
    tensors[0][1].add_(1.0)  # the rebuilt tensor views the same memory
    assert torch.equal(out[0][1], tensors[0][1])
    assert tensors[0][1].is_shared()


def test_payload_is_a_handle_not_bytes():
    big = torch.randn(1 << 20)  # 4 MiB of data
    assert len(serialize_named_tensors([("big", big)])) < 2000


def test_nested_payload_with_bucket_and_metadata():
    (bucket,) = pack_buckets(_mixed_tensors(), 1 << 20)
    payload = {
        "load_format": "flattened_bucket",
        "flattened_tensor_bucket_dict": bucket,
        "extra": [None, 1.5, True, (3, "x"), b"raw", OrderedDict(w=torch.ones(2))],
        "meta": TensorMeta("w", "bfloat16", (2, 3), 16, 12),
    }
    out = deserialize_named_tensors(serialize_named_tensors(payload))
    assert out["load_format"] == "flattened_bucket" and out["meta"] == payload["meta"]
    assert out["extra"][:5] == [None, 1.5, True, (3, "x"), b"raw"]
    assert isinstance(out["extra"][5], OrderedDict) and torch.equal(
        out["extra"][5]["w"], torch.ones(2)
    )
    rebuilt = out["flattened_tensor_bucket_dict"]
    assert isinstance(rebuilt, FlattenedBucket) and rebuilt.metas == bucket.metas
    for (name, want), (_, got) in zip(bucket.named_tensors(), rebuilt.named_tensors(), strict=True):
        assert torch.equal(_bits(got), _bits(want)), name


def test_parameter_round_trip():
    param = torch.nn.Parameter(torch.randn(3))
    ((name, out),) = deserialize_named_tensors(serialize_named_tensors([("p", param)]))
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad
    assert torch.equal(out.detach(), param.detach())


def test_global_sharing_strategy_untouched():
    before = torch.multiprocessing.get_sharing_strategy()
    serialize_named_tensors([("w", torch.ones(3))])
    assert torch.multiprocessing.get_sharing_strategy() == before


# ---- cross-process rebuild -----------------------------------------------------------------


def _child_main(conn) -> None:
    """Receives payload strings, reports what it sees, and writes through shared memory."""
    obj = deserialize_named_tensors(conn.recv())
    tensors = dict(obj["tensors"])
    bucket = dict(obj["bucket"].named_tensors())
    report = {n: (str(t.dtype), tuple(t.shape), _bits(t).tolist()) for n, t in tensors.items()}
    report.update({f"bucket.{n}": _bits(t).tolist() for n, t in bucket.items()})
    conn.send(report)
    assert conn.recv() == "reread"
    conn.send((tensors["w"].tolist(), bucket["f32"].tolist()))
    tensors["w"].view(-1)[0] = -5.0  # written by the child, must be seen by the parent
    _sync(tensors["w"])
    conn.send("written")
    conn.close()


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:  # CUDA writes are asynchronous; the other process reads the memory
        torch.cuda.synchronize()


def _recv(conn, timeout: float = 60.0):
    assert conn.poll(timeout), "child process did not answer"
    return conn.recv()


def _run_child(tensors: dict[str, torch.Tensor], bucket: FlattenedBucket):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_main, args=(child,), daemon=True)
    proc.start()
    try:
        payload = serialize_named_tensors({"tensors": list(tensors.items()), "bucket": bucket})
        assert isinstance(payload, str)
        parent.send(payload)
        report = _recv(parent)
        for name, tensor in [
            *tensors.items(),
            *((f"bucket.{n}", t) for n, t in bucket.named_tensors()),
        ]:
            bits = report[name] if name.startswith("bucket.") else report[name][2]
            assert bits == _bits(tensor).tolist(), name
        for name, tensor in tensors.items():
            assert report[name][:2] == (str(tensor.dtype), tuple(tensor.shape)), name
        tensors["w"].mul_(10.0)  # modified after the child rebuilt: it must see the change
        bucket.named_tensors()[0][1].add_(1.0)
        _sync(tensors["w"])
        expected_w = tensors["w"].tolist()  # before the child may write -5.0 into it
        parent.send("reread")
        seen_w, seen_bucket = _recv(parent)
        assert seen_w == expected_w
        assert seen_bucket == bucket.named_tensors()[0][1].tolist()
        assert _recv(parent) == "written"
        assert tensors["w"].view(-1)[0].item() == -5.0
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_cross_process_rebuild_shares_memory():
    tensors = {
        "w": torch.arange(1.0, 9.0).view(2, 4),
        "bf16": torch.randn(6).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    (bucket,) = pack_buckets(
        [("f32", torch.randn(4)), ("i8", torch.arange(5, dtype=torch.int8))], 1024
    )
    _run_child(tensors, bucket)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cross_process_rebuild_cuda_ipc():
    tensors = {
        "w": torch.arange(1.0, 9.0, device="cuda"),
        "bf16": torch.randn(6, device="cuda", dtype=torch.bfloat16),
    }
    (bucket,) = pack_buckets([("f32", torch.randn(4, device="cuda"))], 1024)
    _run_child(tensors, bucket)


# ---- malicious and malformed payloads ------------------------------------------------------


class _Call:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _stack_global_call(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 pickle calling module.name(arg) via STACK_GLOBAL (allows dotted names)."""

    def short(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    return b"\x80\x04" + short(module) + short(name) + b"\x93" + short(arg) + b"\x85R."


def _malicious_payloads(marker: str) -> list[tuple[str, bytes]]:
    touch = f"touch {marker}"
    py = f"open({marker!r}, 'w').close()"
    return [
        ("posix.system", pickle.dumps(_Call(os.system, touch))),
        ("builtins.eval", pickle.dumps(_Call(builtins.eval, py))),
        ("builtins.exec", pickle.dumps([("w", TensorMeta("w", "float32", (1,), 0, 4)), _Call(exec, py)])),
        ("subprocess.Popen", pickle.dumps(_Call(subprocess.Popen, ["touch", marker]))),
        ("posix.system", pickle.dumps(_Call(posix.system, touch), protocol=0)),
        ("os.system", b"cos\nsystem\n(S'" + touch.encode() + b"'\ntR."),
        ("torch.multiprocessing.reductions.os.system",
         _stack_global_call("torch.multiprocessing.reductions", "os.system", touch)),
        ("torch.load", _stack_global_call("torch", "load", marker)),
        ("torch.multiprocessing.reductions.rebuild_storage_fd",
         _stack_global_call("torch.multiprocessing.reductions", "rebuild_storage_fd", touch)),
    ]  # fmt: skip


def test_malicious_pickles_are_refused_and_execute_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for refused, raw in _malicious_payloads(str(marker)):
        with pytest.raises(UnsafePayloadError, match=f"refers to {refused}, which is not allowed"):
            deserialize_named_tensors(_b64(raw))
        assert not marker.exists(), refused


def test_control_payloads_are_live_without_the_restriction(tmp_path):
    """Plain pickle would run the eval payload, so the refusal test above can fail."""
    marker = tmp_path / "pwned"
    pickle.loads(dict(_malicious_payloads(str(marker)))["builtins.eval"])
    assert marker.exists()


def test_build_opcode_cannot_patch_allowed_classes():
    # torch.Tensor, then state (None, {"pwned": 1}), then BUILD -> setattr(torch.Tensor, ...)
    raw = b"\x80\x04\x8c\x05torch\x8c\x06Tensor\x93N}\x8c\x05pwnedK\x01s\x86b."
    with pytest.raises(UnsafePayloadError, match="opcode BUILD"):
        deserialize_named_tensors(_b64(raw))
    assert not hasattr(torch.Tensor, "pwned")


def test_unsafe_payload_error_is_a_value_error():
    assert issubclass(UnsafePayloadError, ValueError)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not base64 !!", "not valid base64"),
        ("QUJ", "not valid base64"),
        ("", "malformed tensor payload"),
        (_b64(b"\xff\x00garbage"), "malformed tensor payload"),
        (_b64(pickle.dumps([1, 2, 3])[:-3]), "malformed tensor payload"),
        (_b64(pickle.dumps([1, 2]) + b"extra"), "trailing bytes"),
        (123, "must be a base64 str"),
    ],
)
def test_malformed_payloads(data, message):
    with pytest.raises(ValueError, match=message):
        deserialize_named_tensors(data)


def test_truncated_real_payload():
    raw = base64.b64decode(serialize_named_tensors([("w", torch.ones(4))]))
    for cut in (1, len(raw) // 2, len(raw) - 1):
        with pytest.raises(ValueError, match="malformed tensor payload"):
            deserialize_named_tensors(_b64(raw[:cut]))


def test_invalid_bucket_metadata_is_a_value_error():
    bad = FlattenedBucket(torch.zeros(8, dtype=torch.uint8), ())
    object.__setattr__(bad, "metas", (TensorMeta("w", "float32", (4,), 0, 16),))  # lie
    with pytest.raises(ValueError, match="truncated bucket"):
        deserialize_named_tensors(serialize_named_tensors(bad))
