"""Run in a venv with SkyRL's package: SkyRL's own weight-sync code drives our server.

SkyRL's ``RemoteInferenceClient`` (world size, /init_weight_transfer_engine, /collective_rpc
start / update_weights_nccl / finish) and its ``BroadcastTransferStrategy`` /
``BroadcastWeightTransferSender`` (init info, the rank-0 join beside the server's init, the
update_info with ``packed: true``, the update beside the broadcast, the finish) run unchanged.
Stubbed: ``ray`` (only asked for this node's address) and the two vLLM trainer helpers SkyRL
calls, ``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights`` (vLLM's CUDA
communicator; here rank 0 of our gloo group and vLLM's packed layout from trainer_bridge).
Package ``__init__`` files that pull in SkyRL's training stack are skipped.

argv[1]: JSON {"repo", "url", "checkpoint"}.
"""

import asyncio
import json
import os
import sys
import types

args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])

import skyrl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rollout_engine.protocol.weight_broadcast import join_update_group  # noqa: E402
from trainer_bridge.vllm_transfer import VLLM_GROUP, broadcast_weights  # noqa: E402

root = os.path.dirname(skyrl.__file__)
for name in ("skyrl.backends", "skyrl.backends.skyrl_train",
             "skyrl.backends.skyrl_train.inference_servers",
             "skyrl.backends.skyrl_train.weight_sync"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split(".")[1:])]
    sys.modules[name] = package

ray = types.ModuleType("ray")
ray._private = types.SimpleNamespace(
    services=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))
sys.modules["ray"] = ray


class NCCLWeightTransferEngine:
    """The vLLM trainer helpers SkyRL calls (the API of the vLLM it pins)."""

    @staticmethod
    def trainer_init(init_info: dict):
        return join_update_group(init_info["master_address"], init_info["master_port"], 0,
                                 init_info["world_size"], VLLM_GROUP, "gloo", 60.0)

    @staticmethod
    def trainer_send_weights(iterator, trainer_args: dict) -> None:
        broadcast_weights(trainer_args["group"], list(iterator), trainer_args["packed"])


for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
    sys.modules[name] = types.ModuleType(name)
engine_module = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
engine_module.NCCLWeightTransferEngine = NCCLWeightTransferEngine
sys.modules[engine_module.__name__] = engine_module

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)
from skyrl.backends.skyrl_train.weight_sync.base import WeightChunk  # noqa: E402
from skyrl.backends.skyrl_train.weight_sync.broadcast_strategy import (  # noqa: E402
    BroadcastTransferStrategy,
)


async def main() -> None:
    # a one-rank trainer world (SkyRL asks its rank and ends with a barrier)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    client = RemoteInferenceClient(proxy_url=args["url"], server_urls=[args["url"]],
                                   data_parallel_size=1)
    total, _ = await client.get_world_size()
    init_info = BroadcastTransferStrategy.create_init_info(
        types.SimpleNamespace(run_engines_locally=False), total)
    sender, _ = await asyncio.gather(
        asyncio.to_thread(BroadcastTransferStrategy.create_sender, init_info, client),
        client.init_weight_update_communicator(init_info))
    tensors = sorted(load_file(args["checkpoint"]).items())
    chunk = WeightChunk(names=[n for n, _ in tensors],
                        dtypes=[str(t.dtype) for _, t in tensors],
                        shapes=[list(t.shape) for _, t in tensors],
                        tensors=[t for _, t in tensors])
    metadata = {"names": chunk.names,
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": chunk.shapes}
    await sender.send_chunks([chunk], weight_metadata=metadata)
    sender._model_update_group.shutdown()
    await client._call_all_servers("/shutdown_weight_transfer_engine")
    session = client._session
    if session is not None:
        await session.close()
    print("synced", len(tensors), "tensors at world size", init_info.world_size, flush=True)


asyncio.run(main())
