"""The low-acceptance switch-off: a request whose proposals keep failing stops proposing,
re-probes now and then, and outputs never change; the counters say how often it happened."""

from __future__ import annotations

import pytest

from rollout_engine.config.speculative import LOW_ACCEPT_PROBE
from rollout_engine.entrypoints.metrics import Metrics
from rollout_engine.speculative.gate import AcceptanceGate
from tests.rollout_engine.engines import thread_engine
from tests.rollout_engine.speculative.conftest import SPEC, repeated_prompts, run


def test_gate_turns_off_after_misses_reprobes_and_turns_back_on() -> None:
    gate = AcceptanceGate(min_accept=0.5, probe_interval=3)
    assert gate.allows(7)                     # nothing known: propose
    gate.record(7, drafted=4, accepted=0)
    assert gate.allows(7)                     # one miss: 1.0 -> 0.5, still on
    gate.record(7, drafted=4, accepted=0)
    assert gate.estimate(7) == pytest.approx(0.25)
    assert [gate.allows(7) for _ in range(4)] == [False, False, False, True]   # re-probe
    gate.record(7, drafted=4, accepted=3)     # the probe pays: back on
    assert gate.allows(7) and gate.allows(7)
    gate.record(7, drafted=0, accepted=0)     # a step without proposals says nothing
    assert gate.estimate(7) == pytest.approx(1.625)
    assert gate.allows(8)                     # per request: 8 is not 7
    gate.forget({8})
    assert gate.estimate(7) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="probe_interval"):
        AcceptanceGate(0.5, 0)


def test_a_model_that_does_not_copy_switches_off_and_outputs_stay_exact(
        tiny_paths: dict[str, str]) -> None:
    """n-gram on prompts that repeat a passage, with a random model that does not continue
    it: the proposals fail, the requests switch off (and re-probe); outputs equal the plain
    engine's, greedy and sampled."""
    path = tiny_paths["qwen2"]
    prompts = repeated_prompts(4, seed=31)
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
              {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 40, "ignore_eos": True,
               "sampling_seed": 3}] * 2
    for plain in thread_engine(path):
        ref = run(plain, prompts, params, return_logprob=True)
    for spec in thread_engine(path, **SPEC):
        got = run(spec, prompts, params, return_logprob=True)
        info = spec.get_server_info()
    for x, y in zip(ref, got, strict=True):
        assert x["output_ids"] == y["output_ids"]
        lx = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
        ly = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4
    metas = [o["meta_info"] for o in got]
    off = [m["spec_off_low_accept_ct"] for m in metas]
    stats = info["stats"]
    assert sum(off) == stats["spec_off_low_accept_rows"] > 0
    assert stats["spec_off_low_accept_steps"] > 0       # whole batches on the plain step
    max_proposals = SPEC["speculative_num_draft_tokens"] - 1
    # re-probed: more proposals than the two verifies before the switch-off
    assert any(m["spec_off_low_accept_ct"] > LOW_ACCEPT_PROBE
               and m["spec_draft_token_num"] > 2 * max_proposals for m in metas)
    text = Metrics().render(info, alive=True)
    values = {name: float(value) for name, value in
              (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}
    assert values["rollout_engine_spec_off_low_accept_rows_total"] == sum(off)
    assert (values["rollout_engine_spec_off_low_accept_steps_total"]
            == stats["spec_off_low_accept_steps"])
