"""Segments of an exporter killed before releasing them are unlinked by the next one."""

from __future__ import annotations

import os
import subprocess
import sys

from rollout_engine.disaggregation.export import _SHM_DIR, new_segment, sweep_stale_segments


def test_a_dead_exporters_segments_are_swept_and_a_live_ones_kept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = os.path.join(_SHM_DIR, f"rollout_pd_{int(dead.stdout)}_0")
    open(stale, "wb").close()
    live, kv = new_segment(64)
    try:
        assert sweep_stale_segments() >= 1
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        del kv
        os.unlink(live)
