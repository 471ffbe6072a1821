"""The CUDA path's rendezvous speaks vLLM's: the NCCL unique id pickled as vLLM's rank 0
publishes it, in its StatelessProcessGroup store (checked against vLLM itself, in its venv;
the communicator after it needs CUDA)."""

from __future__ import annotations

import os
import pickle
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rollout_engine.protocol.vllm_nccl import UNIQUE_ID_KEY, decode_unique_id, encode_unique_id
from tests.rollout_engine.vllm.test_vllm_weight_transfer import vllm_python
from trainer_bridge.transports.group_ranks import free_port

SCRIPT = str(Path(__file__).parent / "vllm_rendezvous_script.py")
UID = bytes(range(128))


def test_unique_id_round_trip_and_refusals() -> None:
    assert decode_unique_id(encode_unique_id(UID)) == UID
    with pytest.raises(ValueError, match="128"):
        encode_unique_id(b"x")
    with pytest.raises(pickle.UnpicklingError, match="os.system"):
        decode_unique_id(b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(pickle.UnpicklingError):
        decode_unique_id(pickle.dumps(("not", "an", "id")))


@pytest.mark.slow
def test_vllm_reads_our_id_and_we_read_vllms() -> None:
    py = vllm_python()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    run = subprocess.run([py, SCRIPT, "encode"], input=encode_unique_id(UID).hex(),
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert bytes.fromhex(run.stdout.strip().splitlines()[-1]) == UID

    port = free_port()
    host = subprocess.Popen([py, SCRIPT, "host", str(port), UID[::-1].hex()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                              timeout=timedelta(seconds=240))
        assert decode_unique_id(store.get(UNIQUE_ID_KEY)) == UID[::-1]
        store.set("rank1_read", b"1")
        _, err = host.communicate(timeout=120)
        assert host.returncode == 0, err[-2000:]
    finally:
        if host.poll() is None:
            host.kill()
