"""SGLang's ``/start_profile`` and ``/stop_profile``: the torch profiler around scheduler steps.

``start_profile`` arms the profiler: it starts at once, or at forward pass ``start_step`` (the
scheduler's count of forward passes); with ``num_steps`` it stops by itself after that many
forward passes, otherwise at ``stop_profile``. Stopping writes one Chrome trace per scheduler,
``<output_dir>/<profile_prefix><profile_id>-TP-0-<pid>[-<k>].trace.json.gz`` (``k``: the
second and later schedulers of one process, data-parallel replicas in threads; ``output_dir``: the
request's, else ``SGLANG_TORCH_PROFILER_DIR``, else the system's temporary directory), which
``chrome://tracing`` and Perfetto open. ``activities``: ``CPU`` (always recorded), ``GPU`` /
``CUDA`` (CUDA kernels, where the engine runs on CUDA), ``MEM`` (memory events).
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")
NOT_DONE = ("CUDA_PROFILER", "RPD", "XPU")
_IN_PROCESS = itertools.count()   # schedulers built in this process


def trace_suffix() -> str:
    """``-<pid>``, then ``-<k>`` for the k-th later scheduler of this process."""
    k = next(_IN_PROCESS)
    return f"-{os.getpid()}" + (f"-{k}" if k else "")


class Profiler:
    def __init__(self, forward_passes: Callable[[], int], device: torch.device) -> None:
        self.forward_passes = forward_passes
        self.device = device
        self.name_suffix = trace_suffix()
        self.profile: Optional[torch.profiler.profile] = None
        self.armed: Optional[dict[str, Any]] = None   # the start call's settings
        self.start_at = 0
        self.stop_at: Optional[int] = None
        self.written: list[str] = []

    def rpc_start_profile(self, output_dir: Optional[str] = None,
                          start_step: Optional[int] = None, num_steps: Optional[int] = None,
                          activities: Optional[list[str]] = None, with_stack: Optional[bool] = None,
                          record_shapes: Optional[bool] = None, profile_by_stage: bool = False,
                          merge_profiles: bool = False, profile_id: Optional[str] = None,
                          profile_prefix: Optional[str] = None,
                          profile_stages: Optional[list[str]] = None) -> dict[str, Any]:
        if self.armed is not None:
            raise ValueError("a profile is already running: call stop_profile first")
        names = ["CPU", "GPU"] if activities is None else activities
        if not (isinstance(names, list) and all(isinstance(a, str) for a in names)):
            raise ValueError(f"activities: must be a list of names, got {activities!r}")
        bad = [a for a in names if a not in ACTIVITIES]
        if bad:
            why = "not supported here" if set(bad) <= set(NOT_DONE) else "unknown"
            raise ValueError(f"activities: {bad} {why} (supported: {list(ACTIVITIES)})")
        for name, flag in (("profile_by_stage", profile_by_stage),
                           ("merge_profiles", merge_profiles), ("profile_stages", profile_stages)):
            if flag:
                raise ValueError(f"{name}: not supported (one trace per scheduler process)")
        for name, step in (("start_step", start_step), ("num_steps", num_steps)):
            if step is not None and (not isinstance(step, int) or isinstance(step, bool)
                                     or step < (1 if name == "num_steps" else 0)):
                raise ValueError(f"{name}: must be a non-negative integer (num_steps >= 1), "
                                 f"got {step!r}")
        for name, text in (("output_dir", output_dir), ("profile_id", profile_id),
                           ("profile_prefix", profile_prefix)):
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{name}: must be a string, got {text!r}")
        if profile_id is not None and os.sep in profile_id:
            raise ValueError("profile_id: must not contain a path separator")
        out_dir = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()
        os.makedirs(out_dir, exist_ok=True)
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda" and {"GPU", "CUDA"} & set(names):
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        self.armed = {"activities": kinds, "profile_memory": "MEM" in names,
                      "with_stack": bool(with_stack), "record_shapes": bool(record_shapes),
                      "path": os.path.join(out_dir, f"{profile_prefix or ''}"
                                           f"{profile_id or f'{time.time():.3f}'}-TP-0"
                                           f"{self.name_suffix}.trace.json.gz")}
        now = self.forward_passes()
        self.start_at = now if start_step is None else max(start_step, now)
        self.stop_at = None if num_steps is None else self.start_at + num_steps
        self.written = []
        self.poll()
        return {"trace_file": self.armed["path"], "start_step": self.start_at,
                "stop_step": self.stop_at}

    def rpc_stop_profile(self) -> dict[str, Any]:
        if self.armed is None and not self.written:
            raise ValueError("no profile is running: call start_profile first")
        if self.armed is not None:
            self._stop()
        written, self.written = self.written, []   # (or it stopped by itself at num_steps)
        return {"trace_files": written}

    def poll(self) -> None:
        """Start or stop at the step the start call named (called after every step)."""
        if self.armed is None:
            return
        passes = self.forward_passes()
        if self.profile is None and passes >= self.start_at:
            a = self.armed
            self.profile = torch.profiler.profile(
                activities=a["activities"], profile_memory=a["profile_memory"],
                with_stack=a["with_stack"], record_shapes=a["record_shapes"])
            self.profile.start()
        if self.profile is not None and self.stop_at is not None and passes >= self.stop_at:
            self._stop()

    def _stop(self) -> None:
        assert self.armed is not None
        path = self.armed["path"]
        self.armed = None
        if self.profile is None:   # start_step never came: nothing recorded
            return
        profile, self.profile = self.profile, None
        profile.stop()
        profile.export_chrome_trace(path)
        self.written.append(path)
