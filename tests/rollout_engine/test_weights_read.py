"""get_weights_by_name: the scheduler only copies the rows out as bytes (one memcpy); nested
lists are built by the frontend, off the scheduler loop (and off the HTTP event loop)."""

from __future__ import annotations

from safetensors import safe_open

from rollout_engine.protocol.messages import WeightSlice
from rollout_engine.weights.loader import safetensors_files

NAME = "model.layers.0.mlp.down_proj.weight"


def test_rows_leave_the_scheduler_as_bytes(qwen2_path, qwen2_engine):
    r = qwen2_engine.tm.call("get_weights_by_name", name=NAME, truncate_size=3)
    assert r.success and isinstance(r.result, WeightSlice)
    with safe_open(safetensors_files(qwen2_path)[0], framework="pt") as f:
        want = f.get_tensor(NAME)[:3].float().tolist()
    assert r.result.shape == [3, len(want[0])]
    assert r.result.tolist() == want == qwen2_engine.get_weights_by_name(NAME, 3)
