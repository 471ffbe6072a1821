"""The scheduler process does not keep memory per distinct prompt length.

oneDNN builds and keeps a primitive (~0.7 MB at these shapes) per product shape it sees; unbucketed, every
prompt length is a new row count, so a server seeing arbitrary prompt lengths grew by
~9 MB a length (1,030-2,030 tokens) for good. `models.layers.linear` buckets row counts (16 an
octave), so 60 prompt lengths that fall in 4 buckets cost about 4 lengths' worth.
"""

from __future__ import annotations

import psutil
import pytest

from rollout_engine import Engine
from rollout_engine.testing.tiny_model import PRESET_55M, tiny_model_path

SPEC = dict(PRESET_55M, num_layers=1)   # the 55M model's shapes, one layer: quick prefills


@pytest.mark.slow   # hundreds of prompt lengths in a scheduler process
def test_distinct_prompt_lengths_do_not_grow_the_scheduler():
    engine = Engine(model_path=str(tiny_model_path("qwen2", **SPEC)), dtype="float32",
                    device="cpu", num_threads=2, random_seed=0, max_total_tokens=8192)
    try:
        proc = psutil.Process(engine.tm.host.pid)
        greedy = {"max_new_tokens": 1, "temperature": 0.0}

        def prefill(length: int) -> None:
            engine.generate(input_ids=[[100 + (7 * i) % 30000 for i in range(length)]],
                            sampling_params=greedy)
            engine.flush_cache()

        for length in (1060, 1150, 1200, 1260):   # one in each bucket: their primitives built
            prefill(length)
        before = proc.memory_info().rss
        for length in range(1030, 1270, 4):       # 60 lengths, in the same 4 buckets
            prefill(length)
        grown = proc.memory_info().rss - before
        # unbucketed, each length is ~9 MB more (60 lengths: ~500 MB)
        assert grown < 100e6, f"the scheduler grew by {grown / 1e6:.0f} MB over 60 prompt lengths"
    finally:
        engine.shutdown()
