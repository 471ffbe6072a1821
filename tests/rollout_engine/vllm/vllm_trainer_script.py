"""Run in vLLM's own venv: vLLM's trainer-side sender (``NCCLTrainerWeightTransferEngine`` +
``HTTPVLLMWeightSyncClient``) pushes a checkpoint to our server, its NCCL communicator swapped
for rank 0 of our gloo group (this machine has no CUDA). Everything else is vLLM's: the
handshake payload, the update_info, the order and packing of the broadcasts.

argv[1]: JSON {"repo", "url", "port", "checkpoint", "packed", "buffer"}.
"""

import contextlib
import json
import sys
import types
from concurrent.futures import ThreadPoolExecutor

args = json.loads(sys.argv[1])
# our group code without the package's heavy __init__ (it needs only torch)
for name, sub in (("rollout_engine", "rollout_engine"),
                  ("rollout_engine.protocol", "rollout_engine/protocol")):
    module = types.ModuleType(name)
    module.__path__ = [f"{args['repo']}/{sub}"]
    sys.modules[name] = module

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from vllm.distributed.weight_transfer import nccl_engine, packed_tensor  # noqa: E402
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402
from vllm.distributed.weight_transfer.nccl_common import (  # noqa: E402
    NCCLWeightTransferInitInfo,
    worker_init_payload,
)

from rollout_engine.protocol.weight_broadcast import join_update_group  # noqa: E402


class NoStream:
    def synchronize(self) -> None:
        pass


# CPU stand-ins for the CUDA calls around vLLM's broadcasts (streams only order GPU work)
torch.accelerator.current_device_index = lambda: 0
torch.cuda.current_stream = lambda *a, **k: NoStream()
torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
packed_tensor._get_streams = lambda device, n: tuple(NoStream() for _ in range(n))


class GlooCommunicator:
    """PyNcclCommunicator's broadcast over rank 0 of our gloo group."""

    def __init__(self, group) -> None:
        self.group = group

    def broadcast(self, tensor, src, stream=None) -> None:
        self.group.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        self.group.shutdown()


class CheckpointSource(WeightSource):
    def __init__(self, path: str) -> None:
        self.tensors = sorted(load_file(path).items())

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

    def __iter__(self):
        return iter(self.tensors)


client = HTTPVLLMWeightSyncClient(args["url"], timeout=120)
engine = nccl_engine.NCCLTrainerWeightTransferEngine(
    client=client, source=CheckpointSource(args["checkpoint"]), packed=args["packed"],
    packed_buffer_size_bytes=args["buffer"])
# trainer_init's handshake, with our group where it opens its NCCL endpoint
worker_info = NCCLWeightTransferInitInfo(
    master_address="127.0.0.1", master_port=args["port"], rank_offset=1, world_size=2,
    packed=args["packed"], packed_buffer_size_bytes=args["buffer"])
with ThreadPoolExecutor(1) as pool:
    answer = pool.submit(client.init_weight_transfer_engine, worker_init_payload(worker_info))
    group = join_update_group("127.0.0.1", args["port"], 0, 2, "vllm_weight_transfer", "gloo",
                              60.0)
    answer.result()
engine.model_update_group = GlooCommunicator(group)
engine.send_weights()   # start, update_weights beside the broadcasts, finish
client.shutdown_weight_transfer_engine()
engine.model_update_group.destroy()
print("sent", len(engine.source.tensors), flush=True)
