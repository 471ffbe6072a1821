"""A control call that fails inside the scheduler answers with what went wrong, not with the
engine's traceback: that goes to the server's log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.rollout_engine.engines import app_client, thread_engine


@pytest.fixture(scope="module")
def client(qwen2_path: str) -> Iterator[Any]:
    for engine in thread_engine(qwen2_path):
        yield from app_client(engine)


def test_a_failing_control_call_returns_no_traceback(client, tmp_path, caplog):
    # a checkpoint "file" that is a directory: reading it raises IsADirectoryError in the
    # scheduler, an error no handler turns into a 400
    (tmp_path / "model.safetensors").mkdir()
    with caplog.at_level(logging.ERROR, logger="rollout_engine.control.dispatch"):
        r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert r.status_code == 500
    body = r.json()
    message = body["error"]["message"]
    assert body["success"] is False and body["message"] == message
    assert message.startswith("update_weights_from_disk failed: IsADirectoryError"), message
    for leak in ("Traceback", 'File "', ".py", "rollout_engine/"):
        assert leak not in r.text, r.text
    # the server's log has the whole story
    logged = [rec for rec in caplog.records if rec.exc_info is not None]
    assert logged and "update_weights_from_disk" in logged[0].getMessage()
    # and the engine still serves
    out = client.post("/generate", json={"input_ids": [5, 6, 7],
                                         "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 2


def test_a_crashed_tensor_parallel_rank_reports_its_error_without_a_traceback():
    from rollout_engine.runtime.tp_worker import crash_report

    try:
        raise OSError("the shard file is gone")
    except OSError as e:
        report = crash_report(2, e)
    assert report.rank == 2 and report.message == "OSError: the shard file is gone"
