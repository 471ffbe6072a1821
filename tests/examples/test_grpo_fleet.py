"""grpo_fleet.py, the GRPO loop on a Ray fleet of two engines: a few tiny steps run the whole
loop (every step slept, woke and refitted the fleet by one broadcast; every rollout at the
step's version; logprobs equal the trainer's) and print each engine's refit seconds; the slow
test runs it long enough to learn."""

from __future__ import annotations

import os
import sys

import pytest

from tests.examples.test_grpo import EXAMPLES, TOL, _argv, _check_run
from trainer_bridge.ray import LOCAL_ONLY_ENV

os.environ.setdefault(LOCAL_ONLY_ENV, "0")   # read as ray is imported: Ray on 127.0.0.1 only
import ray  # noqa: E402,F401 - CI installs the ray extra (dev)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def examples_on_path():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


@pytest.mark.slow   # a Ray cluster and a GRPO run; the fleet itself: test_ray_fleet.py
def test_grpo_fleet_tiny(tmp_path, capsys):
    import grpo_fleet

    summary = grpo_fleet.main(_argv(tmp_path, tmp_path / "model"))
    assert summary["transport"] == "distributed" and summary["num_engines"] == 2
    _check_run(summary, tmp_path / "grpo_fleet.jsonl", 3)
    assert len(set(summary["engine_pids"])) == 2
    # the initial refit and one per step, each with both engines' own seconds
    assert len(summary["engine_refit_seconds"]) == 4
    assert all(len(row) == 2 and min(row) > 0 for row in summary["engine_refit_seconds"])
    printed = capsys.readouterr().out
    assert "[grpo_fleet] refit to 3: engine 0 " in printed and ", engine 1 " in printed
    assert "[grpo_fleet] mean refit seconds per engine: engine 0 " in printed


@pytest.mark.slow
def test_grpo_fleet_learns(tmp_path):
    import grpo_fleet

    summary = grpo_fleet.main(["--out-dir", str(tmp_path), "--model-dir",
                               str(tmp_path / "model"), "--max-minutes", "6", "--no-wandb",
                               "--no-progress"])
    assert summary["max_probe_abs_diff"] <= TOL
    # expected accuracy at T=1 over all 100 problems: the noise-free learning curve
    assert summary["eval_end_expected_accuracy"] >= summary["eval_start_expected_accuracy"] + 0.15
    assert summary["eval_end_accuracy"] > summary["eval_start_accuracy"]
