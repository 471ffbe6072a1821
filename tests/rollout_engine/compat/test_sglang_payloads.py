"""SGLang-format tensor payloads (slime's flattened buckets, verl's LocalSerializedTensor) are
read by the restricted unpickler, and none of its restrictions is relaxed for them."""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import pickle

import pytest
import torch

from rollout_engine.protocol.sglang_payloads import named_tensors_from_sglang, unpack_sglang_bucket
from rollout_engine.protocol.sglang_types import SglangTensorMetadata
from rollout_engine.protocol.tensor_payload import UnsafePayloadError, deserialize_named_tensors
from tests.rollout_engine.compat.sglang_fakes import (
    LOCAL_SERIALIZED_TENSOR,
    SGLANG_VERSIONS,
    WEIGHT_UPDATER_MODULE,
    FlattenedTensorBucket,
    FlattenedTensorMetadata,
    LocalSerializedTensor,
    file_system_sharing,
    flattened_bucket,
    mp_serialize,
    sglang_modules,
    slime_payloads,
    verl_payload,
)


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


def _mixed() -> list[tuple[str, torch.Tensor]]:
    """Back to back these land at odd byte offsets: bool (3 B) then float32, bf16, int64."""
    g = torch.Generator().manual_seed(0)
    return [
        ("mask", torch.tensor([True, False, True])),
        ("w", torch.randn(3, 5, generator=g)),
        ("bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("i64", torch.arange(-3, 3)),
        ("scalar", torch.tensor(1.5, dtype=torch.float16)),
        ("empty", torch.zeros(0, 4)),
        ("t", torch.randn(4, 6, generator=g).t()),
    ]


def _assert_same(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert _bits(g) == _bits(w), name


@pytest.fixture(autouse=True)
def _file_system():
    with file_system_sharing():
        yield


@pytest.mark.parametrize("as_bytes", [True, False], ids=["uint8-bytes", "per-dtype-elements"])
def test_slime_flattened_bucket_round_trip(as_bytes):
    tensors = _mixed()
    serialized, _keep = slime_payloads(tensors, as_bytes=as_bytes)
    got = []
    for data in serialized:
        payload = deserialize_named_tensors(data)
        assert set(payload) == {"flattened_tensor", "metadata"}
        assert all(isinstance(m, SglangTensorMetadata) for m in payload["metadata"])
        got += named_tensors_from_sglang(payload, "flattened_bucket")
    want = dict(tensors)
    _assert_same(got, [(n, want[n]) for n, _ in got])
    assert len(got) == len(tensors)


def test_back_to_back_bytes_are_reinterpreted_in_place_when_aligned():
    tensors = [("a", torch.arange(4.0)), ("b", torch.arange(2, dtype=torch.int64))]
    bucket = flattened_bucket(tensors)
    with sglang_modules():
        payload = deserialize_named_tensors(mp_serialize(bucket, output_str=True))
    out = dict(unpack_sglang_bucket(payload))
    assert out["a"].data_ptr() == payload["flattened_tensor"].data_ptr()  # a view, no copy
    assert out["b"].tolist() == [0, 1]


def test_our_aligned_layout_described_by_sglang_metadata():
    from rollout_engine.protocol.bucket import pack_buckets

    tensors = _mixed()
    (bucket,) = pack_buckets(tensors, 1 << 20)
    metadata = [FlattenedTensorMetadata(m.name, torch.Size(m.shape), getattr(torch, m.dtype),
                                        m.offset, m.offset + m.nbytes, m.nbytes)
                for m in bucket.metas]
    with sglang_modules():
        data = mp_serialize({"flattened_tensor": bucket.buffer, "metadata": metadata}, True)
    payload = deserialize_named_tensors(data)
    _assert_same(named_tensors_from_sglang(payload, "flattened_bucket"), tensors)


def test_pickled_bucket_object_reads_as_its_dict():
    """SGLang's unpickler admits a FlattenedTensorBucket object; it reads as slime's dict."""
    tensors = _mixed()
    bucket = flattened_bucket(tensors)
    with sglang_modules():
        data = mp_serialize(FlattenedTensorBucket(bucket["flattened_tensor"], bucket["metadata"]),
                            output_str=True)
    payload = deserialize_named_tensors(data)
    assert set(payload) == {"flattened_tensor", "metadata"}
    _assert_same(named_tensors_from_sglang(payload, "flattened_bucket"), tensors)


def test_bucket_object_with_other_fields_is_refused():
    with sglang_modules():
        bucket = FlattenedTensorBucket(torch.zeros(4, dtype=torch.uint8), "not a list")
        data = mp_serialize(bucket, output_str=True)
        bucket.extra = 1
        extra = mp_serialize(bucket, output_str=True)
    with pytest.raises(UnsafePayloadError, match="metadata must be a list"):
        deserialize_named_tensors(data)
    with pytest.raises(UnsafePayloadError, match="exactly the fields"):
        deserialize_named_tensors(extra)


def test_dict_metadata_and_list_of_buckets():
    tensors = _mixed()[:3]
    bucket = flattened_bucket(tensors)
    as_dicts = {"flattened_tensor": bucket["flattened_tensor"],
                "metadata": [vars(m) for m in bucket["metadata"]]}
    with sglang_modules():
        payload = deserialize_named_tensors(mp_serialize([as_dicts, bucket], output_str=True))
    _assert_same(named_tensors_from_sglang(payload, "flattened_bucket"), tensors + tensors)


def test_our_formats_are_left_to_our_reader():
    assert named_tensors_from_sglang([("w", torch.ones(1))], None) is None
    assert named_tensors_from_sglang({"flattened_tensor": 1, "metadata": []}, "direct") is None
    assert named_tensors_from_sglang([], "flattened_bucket") is None


@pytest.mark.parametrize(("change", "message"), [
    ({"end_idx": 10_000, "numel": 10_000 - 0}, "past the end"),
    ({"numel": 11}, "end_idx - start_idx == numel"),
    ({"start_idx": -1, "numel": 13}, "non-negative ints"),
    ({"numel": 8, "end_idx": 8}, "8 bytes, but shape"),
    ({"shape": torch.Size([1 << 40])}, "bytes, but shape"),
    ({"name": 3}, "name must be a str"),
    ({"dtype": "float32"}, "must be a torch dtype"),
])
def test_bad_bucket_metadata_is_refused(change, message):
    bucket = flattened_bucket([("w", torch.arange(3.0))])
    fields = {**vars(bucket["metadata"][0]), **change}
    bucket["metadata"] = [FlattenedTensorMetadata(**fields)]
    with sglang_modules():
        data = mp_serialize(bucket, output_str=True)
    with pytest.raises(ValueError, match=message):
        named_tensors_from_sglang(deserialize_named_tensors(data), "flattened_bucket")


def test_bucket_must_be_one_dimensional():
    bucket = {"flattened_tensor": torch.zeros(2, 8, dtype=torch.uint8), "metadata": []}
    with pytest.raises(ValueError, match="1-D contiguous"):
        unpack_sglang_bucket(bucket)


# ---- verl: LocalSerializedTensor with nested pickles ------------------------------------------


def test_fakes_pickle_under_the_current_module_path():
    """What SGLang >= 0.5.16 (and so verl 0.9.1) puts in the payload names the new module."""
    (data,) = verl_payload([("w", torch.ones(1))])
    assert WEIGHT_UPDATER_MODULE.encode() in base64.b64decode(data)
    assert LOCAL_SERIALIZED_TENSOR["0.5.23"] is LocalSerializedTensor


@pytest.mark.parametrize("sglang_version", SGLANG_VERSIONS)
def test_verl_local_serialized_tensors_round_trip(sglang_version):
    tensors = _mixed()
    (data,) = verl_payload(tensors, sglang_version=sglang_version)
    payload = deserialize_named_tensors(data)
    _assert_same(payload, tensors)


@pytest.mark.parametrize("sglang_version", SGLANG_VERSIONS)
def test_verl_other_ranks_values_are_never_read(sglang_version):
    """tp_size 2: rank 1's values are other GPUs' handles; a rank-0 receiver ignores them."""
    tensors = _mixed()[:2]
    garbage = pickle.dumps(print)  # would be refused if it were read
    serialized = verl_payload(tensors, tp_size=2, other_ranks=garbage,
                              sglang_version=sglang_version)
    assert len(serialized) == 2
    _assert_same(deserialize_named_tensors(serialized[0]), tensors)
    with pytest.raises(UnsafePayloadError, match="refers to builtins.print"):
        deserialize_named_tensors(serialized[0], tp_rank=1)
    with pytest.raises(UnsafePayloadError, match="this receiver is tensor-parallel rank 2"):
        deserialize_named_tensors(serialized[0], tp_rank=2)


def _verl_with_values(values) -> str:
    with sglang_modules():
        return mp_serialize([("w", LocalSerializedTensor(values=values))], output_str=True)


class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_nested_pickles_get_the_same_restrictions(tmp_path):
    marker = tmp_path / "pwned"
    nested = pickle.dumps(_System(f"touch {marker}"))
    with pytest.raises(UnsafePayloadError, match="refers to posix.system"):
        deserialize_named_tensors(_verl_with_values([nested]))
    assert not marker.exists()


def test_nested_payload_shares_the_byte_budget():
    tensors = [(f"w{i}", torch.zeros(256)) for i in range(4)]  # 1 KiB each, one pickle each
    (data,) = verl_payload(tensors)
    assert len(deserialize_named_tensors(data, max_bytes=4096)) == 4
    (data,) = verl_payload(tensors)
    with pytest.raises(UnsafePayloadError, match="cap of 3072"):
        deserialize_named_tensors(data, max_bytes=3072)


def test_nesting_is_one_level_deep():
    (inner,) = verl_payload([("w", torch.ones(2))])
    inner_raw = base64.b64decode(inner)  # a LocalSerializedTensor list inside a value
    with pytest.raises(UnsafePayloadError, match="nests serialized payloads more than once"):
        deserialize_named_tensors(_verl_with_values([inner_raw]))


@pytest.mark.parametrize(("values", "message"), [
    ([], "non-empty list"),
    ("not a list", "non-empty list"),
    ([1, 2], "non-empty list"),
    ([mp_serialize([1, 2])], "must hold one tensor, got list"),
])
def test_bad_local_serialized_tensor_values(values, message):
    with pytest.raises(UnsafePayloadError, match=message):
        deserialize_named_tensors(_verl_with_values(values))


def test_records_accept_only_their_own_fields_once():
    with sglang_modules():
        extra = LocalSerializedTensor(values=[b""])
        extra.evil = 1  # an extra attribute travels in BUILD's state
        data = mp_serialize([extra], output_str=True)
    with pytest.raises(UnsafePayloadError, match=r"exactly the fields \['values'\]"):
        deserialize_named_tensors(data)
    # NEWOBJ with arguments, or BUILD twice on the same record
    cls = (b"\x80\x04\x8c&sglang.srt.model_executor.model_runner\x8c\x15LocalSerializedTensor"
           b"\x93")
    state = b"}\x8c\x06values]C\x01xas"
    with pytest.raises(UnsafePayloadError, match="opcode NEWOBJ"):
        deserialize_named_tensors(base64.b64encode(cls + b"K\x01\x85\x81.").decode())
    with pytest.raises(UnsafePayloadError, match="twice"):
        deserialize_named_tensors(base64.b64encode(cls + b")\x81" + state + b"b" + state
                                                   + b"b.").decode())
    with pytest.raises(UnsafePayloadError, match="without state"):
        deserialize_named_tensors(base64.b64encode(cls + b")\x81.").decode())


def test_build_stays_refused_on_tensors():
    """BUILD is admitted for SGLang's records only, never on a tensor."""
    with sglang_modules():
        raw = base64.b64decode(mp_serialize(torch.ones(2), output_str=True))
    with pytest.raises(UnsafePayloadError, match="opcode BUILD on a CpuTensor"):
        deserialize_named_tensors(base64.b64encode(raw[:-1] + b"}b.").decode())


def test_default_sharing_strategy_is_refused_with_the_fix_named():
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    (data,) = verl_payload([("w", torch.ones(2))])
    with pytest.raises(UnsafePayloadError, match="set_sharing_strategy"):
        deserialize_named_tensors(data)


# ---- across processes ------------------------------------------------------------------------


def _child(conn) -> None:
    from rollout_engine.protocol.sglang_payloads import named_tensors_from_sglang
    from rollout_engine.protocol.tensor_payload import deserialize_named_tensors

    verl, slime = conn.recv()
    out = list(deserialize_named_tensors(verl))
    out += named_tensors_from_sglang(deserialize_named_tensors(slime), "flattened_bucket")
    conn.send([(n, t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
               for n, t in out])
    conn.close()


def test_sglang_payloads_are_read_in_another_process():
    tensors = _mixed()
    (verl,) = verl_payload(tensors)
    (slime,), _keep = slime_payloads(tensors)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send((verl, slime))
        assert parent.poll(60), "child did not answer"
        got = parent.recv()
        assert got == [(n, _bits(t)) for n, t in tensors + tensors]
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def _cuda_child(conn) -> None:
    from rollout_engine.protocol.tensor_payload import UnsafePayloadError, deserialize_named_tensors

    good, bad_uuid = conn.recv()
    out = [(n, t.cpu()) for n, t in deserialize_named_tensors(good)]
    try:
        deserialize_named_tensors(bad_uuid)
        refused = ""
    except UnsafePayloadError as exc:
        refused = str(exc)
    conn.send((out, refused))
    conn.close()


class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sglang_patched_cuda_reductions_device_uuid():
    """monkey_patch_torch_reductions sends the device as its uuid, through
    sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified; read in another process (CUDA
    IPC handles cannot be opened by their own process)."""
    import io
    import sys
    import types
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    module = types.ModuleType("sglang.srt.utils.patch_torch")

    def _rebuild_cuda_tensor_modified(*args):  # never called: the receiver maps the name
        raise AssertionError("the receiver must use its own reconstructor")

    _rebuild_cuda_tensor_modified.__module__ = module.__name__
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    module._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified

    def reduce_with_uuid(tensor):
        _, args = reductions.reduce_tensor(tensor)
        args = list(args)
        args[6] = str(torch.cuda.get_device_properties(args[6]).uuid)
        return _rebuild_cuda_tensor_modified, tuple(args)

    tensors = [("w", torch.randn(5, 3, device="cuda")), ("b", torch.arange(7, device="cuda"))]
    sys.modules[module.__name__] = module
    try:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = reduce_with_uuid
        pickler.dump(tensors)
    finally:
        del sys.modules[module.__name__]
    args = list(reductions.reduce_tensor(tensors[0][1])[1])
    args[6] = "GPU-00000000-0000-0000-0000-000000000000"
    bad = pickle.dumps(_Reduce(reductions.rebuild_cuda_tensor, tuple(args)))
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_child, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send((base64.b64encode(buf.getvalue()).decode(), base64.b64encode(bad).decode()))
        assert parent.poll(120), "child did not answer"
        out, refused = parent.recv()
        for (name, got), (_, want) in zip(out, tensors, strict=True):
            assert torch.equal(got, want.cpu()), name
        assert "no local CUDA device has uuid" in refused
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
