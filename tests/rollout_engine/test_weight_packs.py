"""oneDNN's packed weight copies (`models/weight_packs.py`): the products equal the plain ones,
and no write to a weight, by any path that writes parameters, leaves a product using the
copy packed before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from rollout_engine.memory.memory_saver import create_memory_saver
from rollout_engine.models import weight_packs
from rollout_engine.models.layers import linear
from rollout_engine.models.llama import ModelArch
from rollout_engine.models.registry import build_model
from rollout_engine.weights import disk_reader
from rollout_engine.weights.loader import load_weights, read_hf_config
from rollout_engine.weights.shadow import ShadowWeights

NAME = "model.layers.0.mlp.down_proj.weight"

@pytest.fixture(scope="module")
def model_dir() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2"))


@pytest.fixture()
def model(model_dir):
    m = build_model(ModelArch.from_hf_config(read_hf_config(model_dir)))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _weight(model) -> torch.nn.Parameter:
    param, row0, rows = model.weight_map()[NAME]
    assert row0 == 0 and rows == param.shape[0]
    return param


def _rows(weight: torch.Tensor, num: int = 200) -> torch.Tensor:
    # 200 rows: the packed path (the small-GEMM kernel takes only 32-64), padded to 208
    return torch.randn(num, weight.shape[1], generator=torch.Generator().manual_seed(1))


def _packed_product_is_current(weight: torch.Tensor) -> None:
    x = _rows(weight)
    with torch.no_grad():
        got = linear(x, weight)
    assert weight_packs.has_current(weight), "the product did not pack the weight"
    torch.testing.assert_close(got, F.linear(x, weight.detach()), rtol=1e-5, atol=1e-4)


def test_packing_is_on_with_this_torch():
    assert weight_packs.packing_ok()


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 65, 127, 128, 200, 256, 300])
def test_packed_products_equal_plain_ones(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    for x in (torch.randn(rows, 80, generator=gen), torch.randn(1, rows, 80, generator=gen)):
        with torch.no_grad():
            got = linear(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert weight_packs.packed(w) is weight_packs.packed(w), "a current pack is made again"


def _new_value(weight: torch.Tensor) -> torch.Tensor:
    return torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)) * 3


def test_a_load_is_seen_by_the_next_product(model):
    w = _weight(model)
    _packed_product_is_current(w)
    ptr = w.data_ptr()
    load_weights(model, [(NAME, _new_value(w))])   # plain byte copies into the same storage
    assert w.data_ptr() == ptr
    torch.testing.assert_close(w.detach(), _new_value(w))
    _packed_product_is_current(w)


def test_a_checkpoint_read_is_seen_by_the_next_product(model, model_dir, tmp_path: Path):
    w = _weight(model)
    _packed_product_is_current(w)
    save_file({NAME: _new_value(w)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(read_hf_config(model_dir)))
    disk_reader.load_checkpoint(model, str(tmp_path))
    torch.testing.assert_close(w.detach(), _new_value(w))
    _packed_product_is_current(w)


def test_a_shadow_swap_is_seen_by_the_next_product(model):
    w = _weight(model)
    _packed_product_is_current(w)
    shadow = ShadowWeights(model)
    plan = shadow.plan([NAME], [w.dtype], [tuple(w.shape)])
    assert plan is not None
    plan.views[0].copy_(_new_value(w))
    shadow.commit(plan)
    torch.testing.assert_close(w.detach(), _new_value(w))
    _packed_product_is_current(w)


def test_an_in_place_torch_op_is_seen_by_the_next_product(model):
    w = _weight(model)
    _packed_product_is_current(w)
    with torch.no_grad():
        w.mul_(-2.0)            # outside weight_writes.writing(): the version moves
    _packed_product_is_current(w)


class NoKV:
    """A KV pool with nothing to release: the memory saver over weights alone."""

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        pass

    def allocate(self) -> None:
        pass


@pytest.mark.parametrize("backup", [False, True])
def test_sleep_drops_the_packs_and_wake_packs_afresh(model, backup):
    w = _weight(model)
    before = w.detach().clone()
    _packed_product_is_current(w)
    saver = create_memory_saver(model, NoKV(), backup, torch.device("cpu"))
    saver.release(["weights"])
    assert weight_packs.num_bytes() == 0, "packed copies outlive the weights they were made of"
    assert not weight_packs.has_current(w)
    stale = saver.resume(["weights"])
    assert stale is not backup
    torch.testing.assert_close(w.detach(), before if backup else torch.zeros_like(before))
    _packed_product_is_current(w)
