"""The build toolchain of the CPU kernels: compile a C++ source at first use, load it, check
its ABI, and fall back with one warning.

Each kernel is one C++ file beside its wrapper, exporting plain C functions, compiled with
``torch.utils.cpp_extension`` (ninja, ``-O3 -fopenmp -march=native``) into a shared library
named ``<stem>_<cpu tag>`` (the tag hashes torch's and Python's versions and the CPU) under
``$ROLLOUT_ENGINE_CACHE/torch_extensions`` (torch's default extensions directory when unset),
so later processes only load it. The library exports ``<stem>_abi()``, the version of its C
signatures, which its Python wrapper checks (`open_library`); the wrapper calls it through
ctypes, which releases the GIL while it runs. A kernel that cannot be built or loaded is
`load_or_warn`'s None (after one warning), and its caller keeps its PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional, TypeVar

import torch

logger = logging.getLogger(__name__)

__all__ = ["build_library", "load_or_warn", "open_library"]


def _cpu_tag() -> str:
    """Short hash of what the compiled code depends on: torch, Python, the CPU (-march=native)."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        pass
    key = f"{torch.__version__}|{platform.python_version()}|{cpu}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def open_library(library_path: str, abi_symbol: str, abi: int) -> ctypes.CDLL:
    """Load a built library whose ``abi_symbol()`` must return `abi` (the version of the C
    signatures its Python wrapper describes); a stale build raises."""
    lib = ctypes.CDLL(library_path)
    fn = getattr(lib, abi_symbol, None)
    found = fn() if fn is not None else None
    if found != abi:
        raise RuntimeError(f"{library_path} has ABI {found}, expected {abi} (a stale build: "
                           "delete it to rebuild)")
    return lib


def _kernel_name(stem: str) -> str:
    return f"{stem}_{_cpu_tag()}"


def _build_directory(name: str) -> str:
    """``$ROLLOUT_ENGINE_CACHE/torch_extensions/<name>``, else torch's default
    (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions/<py>_cpu/<name>``)."""
    root = os.environ.get("ROLLOUT_ENGINE_CACHE")
    if not root:
        from torch.utils import cpp_extension

        return cpp_extension._get_build_directory(name, False)
    path = Path(root) / "torch_extensions" / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Serialise our loaders on an flock, which the OS drops when its holder dies.

    torch's own lock is a plain file (``<build_dir>/lock``): a process killed mid-build leaves
    it behind and every later loader waits on it forever. Under our flock no other loader of
    ours is building, so a leftover torch lock is stale and is removed.
    """
    try:
        import fcntl
    except ImportError:     # not POSIX: torch's lock alone
        yield
        return
    with open(Path(build_dir) / "rollout_engine.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (Path(build_dir) / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_library(source: Path, stem: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Compile (or, when up to date, just load) ``source`` into a shared library named
    ``<stem>_<cpu tag>`` under ``_build_directory``; its path. Raises on any failure."""
    from torch.utils import cpp_extension

    name = _kernel_name(stem)
    build_dir = _build_directory(name)
    flags = ["-O3", "-fopenmp", *extra_flags]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    # -fopenmp: at::parallel_for is OpenMP inline code under torch's OpenMP backend; the
    # library links libgomp.so.1, the soname torch already loaded, so one runtime runs both.
    with _build_lock(build_dir):
        path = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], build_directory=build_dir,
                                  is_python_module=False, verbose=False)
    return str(path)


T = TypeVar("T")


def load_or_warn(build: Callable[[], T], what: str, instead: str,
                 off_env: Optional[str] = None) -> Optional[T]:
    """``build()``, or None: when ``$off_env`` is "0" (silently), or after one warning naming
    `what` and what happens `instead` when building or loading it fails in any way."""
    if off_env is not None and os.environ.get(off_env, "1") == "0":
        return None
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - any build/import failure means the fallback
        logger.warning("%s unavailable (%s: %s); %s", what, type(e).__name__,
                       str(e).strip().splitlines()[-1:], instead)
        return None
