"""vLLM's ipc weight-transfer backend on the vLLM face: init_info {"packed"} selects it;
update_weights carries CUDA IPC handles (ipc_handles_pickled, as vLLM's HTTP client sends them).

On CPU every update is checked and then refused (CUDA IPC needs CUDA); a hostile or malformed
one is refused naming its problem, with nothing changed and the server still serving. The GPU
test refits a CUDA server from a real trainer process's handles."""

from __future__ import annotations

import base64
import builtins
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rollout_engine.entrypoints.conftest import LiveServer
from tests.rollout_engine.vllm.weight_server import checkpoints, fresh_greedy, greedy, live_server

UUID = "GPU-3f1c2a9e-5b7d-4e21-9c0a-8d6f4b2e1a7c"   # what str(props.uuid) looks like


def model_tensors() -> list[tuple[str, list[int], torch.dtype]]:
    from safetensors import safe_open

    from rollout_engine.weights.loader import safetensors_files

    out = []
    for f in safetensors_files(checkpoints()[1]):
        with safe_open(f, "pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name)
                out.append((name, list(t.shape), t.dtype))
    return out


def cuda_args(shape: list[int], dtype: torch.dtype, counter: int = 0) -> tuple:
    """``rebuild_cuda_tensor``'s arguments as torch's ``reduce_tensor`` returns them for a
    contiguous CUDA tensor, with plausible handles (no GPU here to make real ones)."""
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    num_bytes = step * dtype.itemsize
    return (torch.Tensor, torch.Size(shape), tuple(stride), 0, torch.storage.TypedStorage,
            dtype, 0, bytes(range(64)), num_bytes, 0, False,
            f"/torch_{os.getpid()}_1834920213_{counter}".encode(), counter, b"\x07" * 64, True)


def encode(obj: Any) -> str:
    """As vLLM's HTTP client puts handles in ``ipc_handles_pickled``."""
    return base64.b64encode(pickle.dumps(obj)).decode()


def update_info(tensors: list[tuple[str, list[int], torch.dtype]], packed: bool = False,
                handles: Any = None) -> dict[str, Any]:
    """An update_info as vLLM's IPC trainer builds it (unpacked: a handle per tensor; packed:
    one uint8 buffer and tensor_sizes)."""
    info: dict[str, Any] = {"names": [n for n, _, _ in tensors],
                            "dtype_names": [str(d).removeprefix("torch.") for _, _, d in tensors],
                            "shapes": [s for _, s, _ in tensors]}
    sizes = [torch.Size(s).numel() * d.itemsize for _, s, d in tensors]
    if handles is None:
        if packed:
            handles = {UUID: cuda_args([sum(sizes)], torch.uint8)}
        else:
            handles = [{UUID: cuda_args(s, d, i)} for i, (_, s, d) in enumerate(tensors)]
    info["ipc_handles_pickled"] = encode(handles)
    if packed:
        info["tensor_sizes"] = sizes
    return info


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(checkpoints()[0], scheduler_mode="process") as s:
        yield s


@pytest.fixture(scope="module")
def before(server: LiveServer) -> dict[str, Any]:
    with server.client() as c:
        version = c.get("/get_weight_version").json()["weight_version"]
    return {"greedy": greedy(server), "version": version}


def post(server: LiveServer, path: str, body: Any = None) -> Any:
    with server.client() as c:
        return c.post(path, json=body)


def start_ipc(server: LiveServer, packed: bool = False) -> None:
    r = post(server, "/init_weight_transfer_engine", {"init_info": {"packed": packed}})
    assert r.status_code == 200, r.text
    r = post(server, "/start_weight_update")
    assert r.status_code == 200, r.text


def assert_nothing_changed(server: LiveServer, before: dict[str, Any]) -> None:
    """The refusal ended the update, the weights are the old ones, and the server serves."""
    r = post(server, "/finish_weight_update", {"weight_version": "bad"})
    assert r.status_code == 400 and "start_weight_update" in r.json()["error"]["message"]
    assert greedy(server) == before["greedy"]
    with server.client() as c:
        assert c.get("/get_weight_version").json()["weight_version"] == before["version"]
    server.assert_no_leak()


class Call:
    """A pickled object whose unpickling calls ``func(*args)`` (what a hostile pickle does)."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def hostile_cases(marker: Path) -> list[tuple[str, Callable[[list], dict], str]]:
    """(id, tensors -> update_info, what the 400 names)."""
    from torch.multiprocessing import reductions

    def with_handles(handles: Callable[[list], Any]) -> Callable[[list], dict]:
        return lambda ts: update_info(ts, handles=handles(ts))

    def one(ts: list, i: int, args: Any) -> list:
        out: list = [{UUID: cuda_args(s, d, j)} for j, (_, s, d) in enumerate(ts)]
        out[i] = {UUID: args}
        return out

    def replaced(info: dict, **fields: Any) -> dict:
        return {**info, **fields}

    shape, dtype = model_tensors()[0][1:]
    good = cuda_args(shape, dtype)
    return [
        ("os.system", with_handles(lambda ts: one(ts, 0, Call(os.system, f"touch {marker}"))),
         "system, which is not allowed"),
        ("builtins.eval", with_handles(lambda ts: one(ts, 0, Call(builtins.eval, "1 + 1"))),
         "builtins.eval, which is not allowed"),
        ("a storage rebuild", with_handles(lambda ts: one(
            ts, 0, Call(reductions.rebuild_storage_filename, torch.UntypedStorage, b"m", b"h", 8))),
         "rebuild_storage_filename, which is not allowed"),
        ("oversized", lambda ts: replaced(update_info(ts), ipc_handles_pickled="A" * (4 << 20)),
         "characters is over"),
        ("wrong arity", with_handles(lambda ts: one(ts, 0, good[:14])),
         "15 arguments (rebuild_cuda_tensor's), got 14"),
        ("too many arguments", with_handles(lambda ts: one(ts, 0, good + (1,))),
         "15 arguments (rebuild_cuda_tensor's), got 16"),
        ("not base64", lambda ts: replaced(update_info(ts), ipc_handles_pickled="not base64!"),
         "base64"),
        ("truncated pickle", lambda ts: replaced(update_info(ts), ipc_handles_pickled=(
            base64.b64encode(pickle.dumps(one(ts, 0, good))[:-7]).decode())), "malformed"),
        ("a handle short", with_handles(lambda ts: one(ts, 0, good)[:-1]), "one per name"),
        ("not a uuid dict", with_handles(lambda ts: [good for _ in ts]), "GPU uuid"),
        ("shape not declared", with_handles(lambda ts: one(ts, 0, cuda_args([2, 2], dtype))),
         "is declared"),
        ("storage too small", with_handles(lambda ts: one(
            ts, 0, good[:8] + (4,) + good[9:])), "needs"),
        ("handle not bytes", with_handles(lambda ts: one(
            ts, 0, good[:7] + ("handle",) + good[8:])), "IPC memory handle must be bytes"),
        ("both handle fields", lambda ts: replaced(update_info(ts), ipc_handles=[]),
         "exactly one of ipc_handles_pickled"),
        ("no handles", lambda ts: {k: v for k, v in update_info(ts).items()
                                   if k != "ipc_handles_pickled"}, "got neither"),
        ("a broadcast field", lambda ts: replaced(update_info(ts), packed=True),
         "unknown field(s) ['packed']"),
        ("a name the model lacks", lambda ts: update_info(
            [(ts[0][0] + ".extra", *ts[0][1:])] + ts[1:]), ".extra"),
        ("JSON handles, wrong arity", lambda ts: replaced(
            {k: v for k, v in update_info(ts).items() if k != "ipc_handles_pickled"},
            ipc_handles=[{UUID: [0] * 14} for _ in ts]),
         "15 arguments (rebuild_cuda_tensor's), got 14"),
        ("JSON handles", lambda ts: replaced(
            {k: v for k, v in update_info(ts).items() if k != "ipc_handles_pickled"},
            ipc_handles=[{UUID: ["torch.Tensor", s, [1], 0, "torch.storage.TypedStorage",
                                 "float32", 0, "aGFuZGxl", 4, 0, False, "/torch_1_2_3", 0,
                                 "ZXZlbnQ=", True]} for _, s, _ in ts]),
         "JSON cannot carry"),
    ]


CASES = [c[0] for c in hostile_cases(Path("unused"))]


@pytest.mark.parametrize("case", CASES)
def test_hostile_or_malformed_update_is_refused(server: LiveServer, before: dict,
                                                tmp_path: Path, case: str) -> None:
    marker = tmp_path / "ran"
    _, build, named = next(c for c in hostile_cases(marker) if c[0] == case)
    start_ipc(server)
    r = post(server, "/update_weights", {"update_info": build(model_tensors())})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert named in message
    assert "needs CUDA" not in message   # malformed is reported as malformed
    assert not marker.exists()
    assert_nothing_changed(server, before)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("route", ["/update_weights", "collective_rpc update_weights_ipc"])
def test_well_formed_update_is_refused_on_cpu(server: LiveServer, before: dict, packed: bool,
                                              route: str) -> None:
    """A payload shaped as vLLM's trainer sends it passes every check, then is refused: the
    handles can only be opened through CUDA."""
    start_ipc(server, packed=packed)
    info = update_info(model_tensors(), packed=packed)
    if route == "/update_weights":
        r = post(server, "/update_weights", {"update_info": info})
    else:
        r = post(server, "/collective_rpc", {"method": "update_weights_ipc",
                                             "kwargs": {"update_info": info}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "ipc weight-transfer backend needs CUDA" in message and "cpu" in message
    assert_nothing_changed(server, before)


def test_packed_is_agreed_at_init(server: LiveServer, before: dict) -> None:
    """The init's packed decides the handles' form: one buffer dict with tensor_sizes."""
    tensors = model_tensors()
    start_ipc(server, packed=True)
    r = post(server, "/update_weights", {"update_info": update_info(tensors)})   # unpacked
    assert r.status_code == 400
    assert "tensor_sizes: required" in r.json()["error"]["message"]
    start_ipc(server, packed=True)
    info = update_info(tensors, packed=True)
    info["tensor_sizes"] = [n + 1 for n in info["tensor_sizes"]]
    r = post(server, "/update_weights", {"update_info": info})
    assert r.status_code == 400 and "tensor_sizes[0]" in r.json()["error"]["message"]
    start_ipc(server, packed=False)
    r = post(server, "/update_weights", {"update_info": {
        **update_info(tensors),
        "ipc_handles_pickled": encode({UUID: cuda_args([4], torch.uint8)})}})
    assert r.status_code == 400 and "one per name" in r.json()["error"]["message"]
    assert_nothing_changed(server, before)


def test_init_info_selects_the_backend(server: LiveServer) -> None:
    r = post(server, "/init_weight_transfer_engine", {"init_info": {"packed": "yes"}})
    assert r.status_code == 400 and "init_info.packed" in r.json()["error"]["message"]
    r = post(server, "/init_weight_transfer_engine", {"init_info": {"packed": True, "x": 1}})
    assert r.status_code == 400 and "['x']" in r.json()["error"]["message"]
    r = post(server, "/collective_rpc", {"method": "init_weight_transfer_engine",
                                         "kwargs": {"init_info": {}}})
    assert r.status_code == 200, r.text
    # a rendezvous field still means the nccl backend (over gloo here), reported as such
    r = post(server, "/init_weight_transfer_engine", {"init_info": {"master_port": 1}})
    assert r.status_code == 400 and "master_address" in r.json()["error"]["message"]
    r = post(server, "/shutdown_weight_transfer_engine")
    assert r.status_code == 200, r.text


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_ipc_transfer_equals_a_fresh_engine(packed: bool) -> None:
    """A trainer process on this GPU sends the W2 checkpoint as vLLM's IPC trainer does
    (ipc_trainer_script.py); the CUDA server then answers as a fresh engine on W2."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from rollout_engine.weights.loader import safetensors_files

    w1, w2 = checkpoints()
    want = fresh_greedy(w2)
    (checkpoint,) = safetensors_files(w2)
    repo = str(Path(__file__).resolve().parents[3])
    with live_server(w1, device="cuda", scheduler_mode="process") as cuda_server:
        assert greedy(cuda_server) != want
        args = {"repo": repo, "url": cuda_server.url, "checkpoint": checkpoint,
                "packed": packed}
        run = subprocess.run([sys.executable, str(Path(__file__).parent /
                                                  "ipc_trainer_script.py"), json.dumps(args)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-1000:]
        assert "synced" in run.stdout
        assert greedy(cuda_server) == want
        with cuda_server.client() as c:
            assert c.get("/get_weight_version").json()["weight_version"] == "ipc"
        cuda_server.assert_no_leak()


VLLM_BODY = """
import json, sys, torch
from dataclasses import asdict
from vllm.distributed.weight_transfer.clients import _json_safe_update_info
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
names, shapes, uuid, packed = json.loads(sys.argv[1])
def args(shape, dtype, i):
    n = torch.Size(shape).numel() * dtype.itemsize
    stride = torch.empty(shape, device="meta").stride()
    return (torch.Tensor, torch.Size(shape), stride, 0, torch.storage.TypedStorage, dtype, 0,
            bytes(range(64)), n, 0, False, b"/torch_1_2_%d" % i, i, b"\\x07" * 64, True)
sizes = [torch.Size(s).numel() * 4 for s in shapes]
handles = ({uuid: args([sum(sizes)], torch.uint8, 0)} if packed
           else [{uuid: args(s, torch.float32, i)} for i, s in enumerate(shapes)])
info = IPCWeightTransferUpdateInfo(names=names, dtype_names=["float32"] * len(names),
                                   shapes=shapes, ipc_handles=handles,
                                   tensor_sizes=sizes if packed else None)
print(json.dumps(_json_safe_update_info(asdict(info))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_vllms_own_update_info_is_read(server: LiveServer, before: dict, packed: bool) -> None:
    """The body vLLM's IPCWeightTransferUpdateInfo and HTTP client make (in vLLM's venv) passes
    every check; on CPU it then meets the CUDA refusal."""
    from tests.rollout_engine.vllm.test_vllm_weight_transfer import vllm_python

    tensors = model_tensors()
    assert {d for _, _, d in tensors} == {torch.float32}
    spec = [[n for n, _, _ in tensors], [s for _, s, _ in tensors], UUID, packed]
    run = subprocess.run([vllm_python(), "-c", VLLM_BODY, json.dumps(spec)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert run.returncode == 0, run.stderr[-3000:]
    body = json.loads(run.stdout.strip().splitlines()[-1])
    assert "ipc_handles_pickled" in body
    start_ipc(server, packed=packed)
    r = post(server, "/update_weights", {"update_info": body})
    assert r.status_code == 400, r.text
    assert "ipc weight-transfer backend needs CUDA" in r.json()["error"]["message"]
    assert_nothing_changed(server, before)
