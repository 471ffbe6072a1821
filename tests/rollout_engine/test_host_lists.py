"""`list_tensor` is `torch.tensor` for the flat lists the scheduler builds each step."""

from __future__ import annotations

import pytest
import torch

from rollout_engine.host_lists import list_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
@pytest.mark.parametrize("values", [[], [7], [0, -3, 2**31 - 1, 5], list(range(300))])
def test_equals_torch_tensor(values, dtype):
    got = list_tensor(values, dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu"
    assert torch.equal(got, want)


def test_floats_and_other_dtypes_follow_torch_tensor():
    assert torch.equal(list_tensor([0.5, 1.25], torch.float32), torch.tensor([0.5, 1.25]))
    # floats asked for as int64: array refuses them, torch.tensor's rules apply
    assert torch.equal(list_tensor([1.7, -2.2]), torch.tensor([1.7, -2.2], dtype=torch.int64))
    assert torch.equal(list_tensor([True, False], torch.bool), torch.tensor([True, False]))


def test_the_tensor_outlives_the_list_and_is_writable():
    values = [1, 2, 3]
    t = list_tensor(values)
    del values
    t += 1
    assert t.tolist() == [2, 3, 4]
