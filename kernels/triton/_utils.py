"""Small helpers shared by the kernel launchers and their tests."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["interpret_mode", "kernel_device_ok", "next_power_of_2", "triton_available"]


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it may still lack a GPU)."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The flag is read when a ``@triton.jit`` function is defined, i.e. when a kernel module
    is imported, so it must be set before that import.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_device_ok(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` if the tensors cannot be handed to a Triton kernel here.

    Compiled kernels need CUDA tensors; the interpreter needs CPU tensors.
    """
    want = "cpu" if interpret_mode() else "cuda"
    for t in tensors:
        if t.device.type != want:
            hint = (
                "move the inputs to CPU or unset TRITON_INTERPRET"
                if want == "cpu"
                else "move the inputs to CUDA, or set TRITON_INTERPRET=1 before importing "
                "triton to run kernels on CPU"
            )
            raise ValueError(
                f"Triton kernel got a tensor on {t.device.type!r} but expects {want!r}: {hint}"
            )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (``tl.arange`` sizes must be powers of two)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
