"""`ShadowWeights`: an update received into spare parameter storage and swapped in equals a
copy into the parameters, keeps the rows it does not carry, and never touches the live weights
before it commits."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.models.llama import ModelArch
from rollout_engine.models.registry import build_model
from rollout_engine.weights.loader import load_weights, read_hf_config
from rollout_engine.weights.shadow import ShadowWeights, _uncovered

QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from rollout_engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path("qwen2"))


def _model(model_dir: str) -> torch.nn.Module:
    model = build_model(ModelArch.from_hf_config(read_hf_config(model_dir)))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _announce(model, names):
    table = model.weight_map()
    specs = []
    for n in names:
        p, _, rows = table[n]
        specs.append((n, p.dtype, (rows, *p.shape[1:])))
    return [n for n, _, _ in specs], [d for _, d, _ in specs], [s for _, _, s in specs]


def _receive(shadow, model, names, values):
    plan = shadow.plan(*_announce(model, names))
    assert plan is not None
    for view, value in zip(plan.views, values):
        view.copy_(value)          # what the broadcast writes
    return plan


def test_swap_equals_a_copy_and_keeps_uncarried_rows(model_dir):
    swapped, copied = _model(model_dir), _model(model_dir)
    names = ["model.embed_tokens.weight", "model.norm.weight", *QKV[:2]]   # q and k, not v
    table = swapped.weight_map()
    values = [torch.randn(table[n][2], *table[n][0].shape[1:]) for n in names]
    shadow = ShadowWeights(swapped)
    before = {n: p.detach().clone() for n, p in swapped.named_parameters()}
    plan = _receive(shadow, swapped, names, values)
    # nothing live changed while the bytes arrive
    for n, p in swapped.named_parameters():
        assert torch.equal(p, before[n]), n
    report = shadow.commit(plan)
    assert report.names == frozenset(names) and report.num_tensors == len(names)
    load_weights(copied, list(zip(names, values)))
    for (n, a), (_, b) in zip(swapped.named_parameters(), copied.named_parameters()):
        assert torch.equal(a, b), n     # v's rows and the vocabulary padding kept too


def test_spares_alternate_and_a_second_update_is_exact(model_dir):
    model = _model(model_dir)
    shadow = ShadowWeights(model)
    table = model.weight_map()
    norm = table["model.norm.weight"][0]
    ptrs = [norm.data.data_ptr()]
    for value in (1.0, 2.0, 3.0):
        plan = _receive(shadow, model, ["model.norm.weight"], [torch.full_like(norm, value)])
        shadow.commit(plan)
        assert torch.equal(norm.data, torch.full_like(norm, value))
        ptrs.append(norm.data.data_ptr())
    # two storages trade places: no third one is ever allocated
    assert ptrs[1] != ptrs[0] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]


def test_an_aborted_update_changes_nothing_and_frees_its_parameters(model_dir):
    model = _model(model_dir)
    shadow = ShadowWeights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = ["model.norm.weight"]
    plan = _receive(shadow, model, names, [torch.zeros(model.weight_map()[names[0]][2])])
    assert shadow.plan(*_announce(model, names)) is None     # busy until committed or aborted
    shadow.abort(plan)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert shadow.plan(*_announce(model, names)) is not None


def test_updates_the_swap_does_not_take(model_dir):
    model = _model(model_dir)
    shadow = ShadowWeights(model)
    names, dtypes, shapes = _announce(model, ["model.norm.weight", QKV[1]])
    assert shadow.plan(names, dtypes, shapes) is None          # k alone: a small share of qkv
    assert shadow.plan(["nope"], dtypes[:1], shapes[:1]) is None
    assert shadow.plan(names[:1], [torch.bfloat16], shapes[:1]) is None   # needs a cast
    assert shadow.plan(names[:1], dtypes[:1], [(3,)]) is None            # wrong shape
    assert shadow.plan(names[:1] * 2, dtypes[:1] * 2, shapes[:1] * 2) is None   # twice
    assert shadow.num_bytes == 0
    plan = shadow.plan(names[:1], dtypes[:1], shapes[:1])
    assert plan is not None and shadow.num_bytes > 0
    shadow.abort(plan)
    shadow.release()
    assert shadow.num_bytes == 0


def test_uncovered_rows():
    assert _uncovered([(0, 4), (6, 2)], 10) == [(4, 6), (8, 10)]
    assert _uncovered([(4, 6), (0, 4)], 10) == []
    assert _uncovered([], 3) == [(0, 3)]


def test_the_engine_frees_its_spares_with_its_last_group(make_engine, model_dir):
    """Spare weights exist while a weight-update group does: destroying the last group frees
    them (a broadcast refit's memory is the group's, as a staging buffer's would be)."""
    import threading

    from rollout_engine.protocol.weight_broadcast import join_update_group
    from rollout_engine.weights.loader import iter_safetensors
    from trainer_bridge.transports.group_ranks import free_port

    engine = make_engine(model_dir)

    def held() -> int:
        return engine.get_server_info()["weight_update_buffer_bytes"]

    port, box = free_port(), {}
    joiner = threading.Thread(target=lambda: box.update(j=engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, group_name="g", backend="gloo")), daemon=True)
    joiner.start()
    pg = join_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)
    joiner.join(60)
    norm = dict(iter_safetensors(model_dir))["model.norm.weight"].contiguous()
    t = threading.Thread(target=lambda: box.update(r=engine.update_weights_from_distributed(
        ["model.norm.weight"], ["float32"], [list(norm.shape)], group_name="g")), daemon=True)
    t.start()
    pg.broadcast(norm).wait()
    t.join(60)
    assert box["r"][0], box
    assert held() == norm.numel() * 4      # received in place: a spare norm, no staging
    assert engine.destroy_weights_update_group("g")[0]
    assert held() == 0
    pg.shutdown()
