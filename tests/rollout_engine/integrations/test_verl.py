"""verl 0.9.1's own classes drive our server: its replica registry and rollout-class table
resolve ``rollout_engine`` (through verl's plugin loading of our entry point), its
``RolloutReplica`` methods pause, reject, sleep and wake the server, and its trainer-side
adapter refits it, against a live ``launch_server``.

verl is installed in a virtual environment of its own, built once per cache directory over the
project's environment (``--system-site-packages``: its torch, ray, transformers, fastapi):
``pip install --no-deps`` of verl and the few modules its replica, config and rollout-base
modules import that the project lacks. The whole verl package with its dependencies does not
install next to the project's (it pins transformers < 5.11 and pulls vllm / sglang extras).
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.venvs import client_venv

ROOT = Path(__file__).resolve().parents[3]
VERL_PACKAGES = ["verl==0.9.1", "tensordict==0.10.0", "pyvers==0.2.3", "omegaconf==2.4.0",
                 "antlr4-python3-runtime==4.13.2", "codetiming==1.4.0"]
GREEDY_LEN = 6


@pytest.fixture(scope="session")
def verl_python() -> Path:
    return client_venv("verl-venv", VERL_PACKAGES, system_site_packages=True, no_deps=True)


def _plugin_dir(tmp_path: Path) -> Path:
    """A distribution declaring pyproject.toml's ``verl.plugins`` entry points, as an install of
    the project does (the checkout under test may not be the installed one)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["verl.plugins"]
    info = tmp_path / "rollout_engine_under_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rollout-engine-under-test\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        "[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return tmp_path


@pytest.fixture(scope="module")
def seen(verl_python: Path, qwen2_path: str, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    plugins = _plugin_dir(tmp_path_factory.mktemp("verl_plugin"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)   # registration must come from the entry point
    proc = subprocess.run([str(verl_python), str(Path(__file__).with_name("verl_driver.py")),
                           qwen2_path, str(plugins)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_verl_resolves_the_rollout_name_through_its_plugin_loading(seen):
    assert seen["classes"] == [
        "rollout_engine.integrations.verl.replica.RolloutEngineReplica",
        "rollout_engine.integrations.verl.adapter.ServerAdapter"]
    assert seen["subclasses"] == [True, True]


def test_generate_returns_tokens_and_their_logprobs(seen):
    first = seen["first"]
    assert len(first["token_ids"]) == GREEDY_LEN == len(first["log_probs"])
    assert all(lp <= 0 for lp in first["log_probs"])
    assert first["stop_reason"] == "completed" and first["global_steps"] is None
    assert seen["default_length"] == 16   # verl's response_length when none is asked


def test_pause_aborts_running_requests_and_holds_or_rejects_new_ones(seen):
    aborted = seen["aborted"]
    assert aborted["stop_reason"] == "aborted"
    assert 0 < aborted["num_tokens"] < 500 and len(aborted["log_probs"]) == aborted["num_tokens"]
    assert seen["held_while_paused"] is True
    assert seen["held"]["token_ids"] == seen["first"]["token_ids"]   # served once resumed
    assert seen["rejected"] == {"token_ids": [], "log_probs": None, "stop_reason": "aborted",
                                "global_steps": None}


def test_sleep_and_wake_up(seen):
    assert "asleep" in seen["asleep_error"] and "503" in seen["asleep_error"]
    assert seen["woken"]["token_ids"] == seen["first"]["token_ids"]   # weights kept (colocated)


def test_refit_through_the_trainer_side_adapter(seen):
    assert seen["leader"] is True
    refit, restored = seen["refit"], seen["restored"]
    assert refit["global_steps"] == 7 and restored["global_steps"] == 8
    assert refit["log_probs"] != seen["first"]["log_probs"]           # halved weights
    assert restored["token_ids"] == seen["first"]["token_ids"]        # the originals again
    assert restored["log_probs"] == pytest.approx(seen["first"]["log_probs"], abs=1e-5)
    assert "no_such" in seen["bad_refit"] and "400" in seen["bad_refit"]
    assert seen["after_bad"]["token_ids"] == seen["first"]["token_ids"]
    assert seen["after_bad"]["global_steps"] == 8                     # refused: nothing changed
    assert seen["exit_code"] == 0


@pytest.mark.slow
def test_verl_colocated_replica_on_ray(verl_python: Path, qwen2_path: str, tmp_path: Path):
    """verl's replica on a local Ray: ``init_colocated`` starts verl's CheckpointEngineWorker
    (whose adapter verl builds by name in the worker) and our server actor; generation, sleep /
    wake, a rejecting pause and two refits by the worker's adapter go through the actors
    (about a minute: Ray, three processes importing verl and the server)."""
    plugins = _plugin_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(verl_python), str(Path(__file__).with_name("verl_ray_driver.py")),
                           qwen2_path, str(plugins), str(ROOT)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["address"].startswith("127.0.0.1:")
    first = seen["first"]
    assert len(first["token_ids"]) == GREEDY_LEN and first["stop_reason"] == "completed"
    assert seen["woken"] == first
    assert seen["rejected"] == {"token_ids": [], "stop_reason": "aborted", "global_steps": None}
    assert seen["refit"]["global_steps"] == 5 and seen["refit"]["token_ids"] != first["token_ids"]
    assert seen["restored"] == {**first, "global_steps": 6}
    assert seen["exit_code"] == 0
