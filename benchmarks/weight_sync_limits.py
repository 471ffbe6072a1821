"""The limits `bench_weight_sync.py` measures each refit path against, and vLLM's reload.

Each path's physical limit on the same bytes (`Rooflines`, timed right before each refit it
bounds), the raw two-process gloo broadcast behind the distributed one (`RawBroadcast`), and
vLLM CPU's ``reload_weights`` of the same directory as the peer (its own venv).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import vllm_peer
from rollout_engine.protocol.byte_copy import copy_all
from rollout_engine.protocol.weight_broadcast import join_update_group
from rollout_engine.weights.loader import safetensors_files
from trainer_bridge.transports.group_ranks import free_port
from trainer_bridge.transports.tensor import shared_buffer

CAST = torch.bfloat16   # the cast row's trainer dtype (the engine is float32)
ROUND_ROBIN_BYTES = 1 << 30   # models up to this size run a transport's rows in turns



def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _raw_receiver(port: int, sizes: list[int]) -> None:
    """Rank 1 of `RawBroadcast` (a spawned process): receive until told to stop, each time
    the bytes as one flat buffer (flag 1) or as one buffer per tensor (flag 2)."""
    torch.set_num_threads(1)
    group = join_update_group("127.0.0.1", port, 1, 2, "raw", "gloo", 600.0)
    flat = [torch.empty(sum(sizes), dtype=torch.uint8)]
    per_tensor, used = [], 0   # views of the same buffer (a second one would not fit at 540M)
    for n in sizes:
        per_tensor.append(flat[0][used:used + n])
        used += n
    flag = torch.zeros(1)
    while True:
        group.broadcast(flag).wait()
        if not flag.item():
            break
        for work in [group.broadcast(b) for b in (flat if flag.item() == 1 else per_tensor)]:
            work.wait()
        group.broadcast(torch.zeros(1), src=1).wait()   # "received": rank 0 stops its clock
    group.shutdown()


class RawBroadcast:
    """The distributed roofline: one gloo broadcast of the payload's bytes, as one flat buffer,
    from this process to a second one, timed until that process has all of it. `per_tensor`
    times the same bytes as one broadcast per tensor (what a trainer sends without packing,
    SGLang's ``load_format`` None), from the trainer's tensors into consecutive slices of the
    receiver's buffer: gloo's own cost of many operations, with no engine in between."""

    def __init__(self, buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        import multiprocessing as mp

        port = free_port()
        sizes = [t.numel() * t.element_size() for t in tensors]
        assert sum(sizes) == buf.numel()
        self.child = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, sizes),
                                                     daemon=True)
        self.child.start()
        self.group = join_update_group("127.0.0.1", port, 0, 2, "raw", "gloo", 600.0)
        self.buf = buf
        self.tensors = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]

    def once(self, per_tensor: bool = False) -> float:
        self.group.broadcast(torch.full((1,), 2.0 if per_tensor else 1.0)).wait()
        t0 = time.perf_counter()
        for work in [self.group.broadcast(b) for b in (self.tensors if per_tensor
                                                        else [self.buf])]:
            work.wait()
        self.group.broadcast(torch.zeros(1), src=1).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.group.broadcast(torch.zeros(1)).wait()
        self.group.shutdown()
        self.child.join(60)


class Rooflines:
    """Each path's physical limit on the same bytes, timed by `time(family)` right before each
    refit it bounds (the machine is shared: its memory bandwidth swings ~2x from minute to
    minute, so a refit is paired with the limit measured next to it):

    memcpy: the fastest of copy_ (torch's threads), one thread's and two threads' `copy_all`
    (what the engine's apply uses: streaming stores from 4 MB, the fastest copy we have)
    between two preallocated fp32 tensors; shm copy: the same copy out of POSIX shared memory
    (what the engine's apply reads: tmpfs maps it in 4 KB pages; models up to
    ROUND_ROBIN_BYTES); cast: bf16 -> fp32 copy_; raw broadcast: `RawBroadcast` (and its
    per-tensor variant, a reference, not a goal); read + copy: the checkpoint files read into
    a preallocated buffer, then the fastest copy (as for memcpy) of those bytes into
    preallocated tensors (page cache warm); read alone.
    """

    def __init__(self, model_path: str, num_bytes: int, tensors: list[torch.Tensor]) -> None:
        self.files = safetensors_files(model_path)
        self.sizes = [Path(f).stat().st_size for f in self.files]
        self.dst = torch.empty(max(num_bytes, max(self.sizes)) // 4, dtype=torch.float32)
        self.src = torch.ones_like(self.dst)
        self.cast_src = torch.ones(num_bytes // 4, dtype=CAST)
        # a big model has no room for one more model's worth (measured apart, see the report)
        self.shm_src = (shared_buffer(num_bytes, torch.device("cpu")).fill_(1)
                        if num_bytes <= ROUND_ROBIN_BYTES else None)
        self.num_bytes = num_bytes
        self.bcast = RawBroadcast(self.src.view(torch.uint8)[:num_bytes], tensors)

    def _read(self, i: int) -> torch.Tensor:
        buf = self.src.view(torch.uint8)[:self.sizes[i]]
        with open(self.files[i], "rb", buffering=0) as f:
            view = memoryview(buf.numpy())
            while view:
                view = view[f.readinto(view):]
        return buf

    def _read_copy(self) -> None:
        out = self.dst.view(torch.uint8)
        copy_all([(out[:self.sizes[i]], self._read(i)) for i in range(len(self.files))])

    def time(self, family: Optional[str] = None) -> dict[str, float]:
        """One timing of each limit of `family` ("tensor", "distributed", "disk"; None: all)."""
        out: dict[str, float] = {}
        n = self.num_bytes // 4
        if family in (None, "tensor"):
            torch_copy = timed(lambda: self.dst[:n].copy_(self.src[:n]))
            one_thread = timed(lambda: copy_all([(self.dst[:n], self.src[:n])], num_threads=1))
            two_threads = timed(lambda: copy_all([(self.dst[:n], self.src[:n])]))
            shm_src = self.shm_src
            if shm_src is not None:
                out["shm_copy_seconds"] = timed(lambda: copy_all(
                    [(self.dst.view(torch.uint8)[:self.num_bytes], shm_src)]))
            out.update({
                "memcpy_seconds": min(torch_copy, one_thread, two_threads),
                "memcpy_torch_seconds": torch_copy, "memcpy_one_thread_seconds": one_thread,
                "memcpy_two_threads_seconds": two_threads,
                "cast_copy_seconds": timed(lambda: self.dst[:n].copy_(self.cast_src))})
        if family in (None, "distributed"):
            out["raw_broadcast_seconds"] = self.bcast.once()
            out["raw_per_tensor_broadcast_seconds"] = self.bcast.once(per_tensor=True)
        if family in (None, "disk"):
            out["read_copy_seconds"] = timed(self._read_copy)
            out["read_seconds"] = timed(lambda: [self._read(i) for i in range(len(self.files))])
        return out

    def close(self) -> None:
        self.bcast.close()


VLLM_SCRIPT = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
import vllm
llm = LLM(model=args["model_dir"], dtype="float32", max_model_len=512, seed=0,
          enforce_eager=True)
greedy = SamplingParams(max_tokens=4, temperature=0)
before = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy)[0].outputs[0].token_ids
def reload():
    llm.collective_rpc("reload_weights", kwargs={"weights_path": args["model_dir"]})
reload()
secs = []
for _ in range(args["repeats"]):
    t0 = time.perf_counter(); reload(); secs.append(time.perf_counter() - t0)
after = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy)[0].outputs[0].token_ids
print("RESULT " + json.dumps({"seconds": secs, "vllm": vllm.__version__,
                              "same_tokens_after_reload": list(before) == list(after)}))
"""


def vllm_reload_seconds(model_path: str, repeats: int) -> Optional[dict[str, Any]]:
    """vLLM CPU's reload_weights of `model_path` (best of `repeats`), or None without vLLM."""
    py = vllm_peer.vllm_python(setup=False)
    if py is None:
        return None
    res = vllm_peer.run_vllm_script(py, VLLM_SCRIPT, {"model_dir": model_path,
                                                      "repeats": repeats}, timeout=1800)
    if res is None:
        return None
    return {**res, "best_seconds": min(res["seconds"])}
