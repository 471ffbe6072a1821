"""Counter-based randomness: the uniform number behind output token ``k`` of a request is a hash
of ``(sampling_seed, k)`` (splitmix64), so a request draws the same sample whatever else is in
the batch, and a retracted request that is recomputed continues exactly where it stopped."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["derive_seed", "seed_mix", "splitmix64", "uniform_for", "uniforms_for",
           "uniforms_from_mix"]

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on ``(seed, step)`` (53 random bits)."""
    return (splitmix64(splitmix64(seed) ^ step) >> 11) * (1.0 / (1 << 53))


def uniforms_for(seeds: list[int], steps: list[int]) -> torch.Tensor:
    """``[uniform_for(s, k) for s, k in zip(seeds, steps)]`` as a float64 tensor, computed on
    uint64 arrays (numpy's wrap around 2^64 is splitmix64's ``& _MASK64``): bit-identical, and
    a batch's worth of Python big-int arithmetic less per step."""
    return uniforms_from_mix(seed_mix(seeds), steps)


def seed_mix(seeds: list[int]) -> np.ndarray:
    """``splitmix64(seed)`` of each seed (uint64): the per-request half of ``uniform_for``."""
    x = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _splitmix64_array(x)


def uniforms_from_mix(mix: np.ndarray, steps: list[int]) -> torch.Tensor:
    """``uniforms_for`` from the seeds' ``seed_mix``."""
    k = np.array(steps, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        u = _splitmix64_array(mix ^ k) >> np.uint64(11)
    return torch.from_numpy(u.astype(np.float64) * (1.0 / (1 << 53)))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th parallel sample (``n > 1``) of a request seeded ``seed``."""
    return splitmix64(seed ^ splitmix64(index + 1)) & ((1 << 63) - 1)
