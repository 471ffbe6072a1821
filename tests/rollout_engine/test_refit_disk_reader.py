"""The disk refit reads safetensors straight into the parameters: bit for bit what the
safetensors library's reader + load_weights give, for one file or several shards, casting a
bf16 checkpoint into fp32 parameters, and refusing a bad checkpoint before writing anything."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_engine.config import EngineConfig
from rollout_engine.model_runner.model_runner import ModelRunner
from rollout_engine.testing.tiny_model import tiny_model_path
from rollout_engine.weights import disk_reader
from rollout_engine.weights.loader import iter_safetensors, load_weights


def _model(path: str) -> torch.nn.Module:
    return ModelRunner(EngineConfig(model_path=path, device="cpu", dtype="float32",
                                    max_total_tokens=64)).model


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _copy_config(src: str, dst: Path) -> None:
    for f in Path(src).iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())


def _sharded(src: str, dst: Path, num_shards: int, dtype: torch.dtype = torch.float32) -> None:
    """`src`'s weights split over `num_shards` files with an index, in `dtype`."""
    _copy_config(src, dst)
    named = [(n, t.to(dtype).contiguous()) for n, t in iter_safetensors(src)]
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = dict(named[i::num_shards])
        save_file(part, str(dst / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("num_shards,dtype", [(1, torch.float32), (3, torch.float32),
                                              (2, torch.bfloat16)])
def test_reads_exactly_what_the_library_reads(tmp_path, num_shards, dtype):
    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    _sharded(w2, tmp_path, num_shards, dtype)
    expected_model = _model(w1)
    load_weights(expected_model, list(iter_safetensors(str(tmp_path))))
    expected = _params(expected_model)

    model = _model(w1)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    report = disk_reader.load_checkpoint(model, str(tmp_path))
    assert report.num_cast == (0 if dtype == torch.float32 else report.num_tensors)
    for name, p in model.named_parameters():
        assert p.data_ptr() == ptrs[name]   # written in place
        assert torch.equal(p, expected[name]), name


def test_small_pieces_and_one_thread_read_the_same(tmp_path, monkeypatch):
    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    model = _model(w1)
    disk_reader.load_checkpoint(model, w2)
    expected = _params(model)
    monkeypatch.setattr(disk_reader, "PIECE_BYTES", 1000)   # not a multiple of any item size
    monkeypatch.setattr(disk_reader, "NUM_THREADS", 1)
    model = _model(w1)
    disk_reader.load_checkpoint(model, w2)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("damage,message", [
    ("truncate", "truncated"),
    ("offsets", "data_offsets"),
    ("shape", "shape"),
    ("unknown", "unknown weight name"),
])
def test_a_bad_checkpoint_changes_nothing(tmp_path, damage, message):
    w1, w2 = str(tiny_model_path("qwen2")), str(tiny_model_path("qwen2", seed=1))
    _copy_config(w2, tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(Path(w2, "model.safetensors").read_bytes())
    first = next(k for k in json.loads(file.read_bytes()[8:8 + struct.unpack(
        "<Q", file.read_bytes()[:8])[0]]) if k != "__metadata__")
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[:-7])
    elif damage == "offsets":
        _rewrite_header(file, lambda h: h[first]["data_offsets"].__setitem__(1, h[first][
            "data_offsets"][1] + 4))
    elif damage == "shape":
        _rewrite_header(file, lambda h: h[first].__setitem__("shape", [1, 1]))
    else:
        _rewrite_header(file, lambda h: h.__setitem__("model.nope", dict(h[first])))
    model = _model(w1)
    before = _params(model)
    with pytest.raises(ValueError, match=message):
        disk_reader.load_checkpoint(model, str(tmp_path))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
