"""A trainer process sending a checkpoint over vLLM's ipc backend, as vLLM's
IPCTrainerWeightTransferEngine and its HTTP client do: handles from torch's reduce_tensor keyed
by this GPU's UUID, pickled and base64 encoded into ``ipc_handles_pickled``; unpacked, one
handle per tensor (the tensors kept alive past finish); packed, one reused buffer, a chunk per
update call. Argument: a JSON object {repo, url, checkpoint, packed}."""

from __future__ import annotations

import base64
import json
import pickle
import sys
from typing import Any


def main() -> None:
    args = json.loads(sys.argv[1])
    sys.path.insert(0, args["repo"])
    import httpx
    import torch
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor

    tensors = [(n, t.cuda()) for n, t in sorted(load_file(args["checkpoint"]).items())]
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    client = httpx.Client(base_url=args["url"], timeout=120)

    def post(path: str, body: Any = None) -> None:
        r = client.post(path, json=body)
        if r.status_code != 200:
            raise SystemExit(f"{path}: {r.status_code} {r.text}")

    def update(chunk: list[tuple[str, torch.Tensor]], handles: Any,
               sizes: Any = None) -> None:
        info = {"names": [n for n, _ in chunk],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in chunk],
                "shapes": [list(t.shape) for _, t in chunk],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
        if sizes is not None:
            info["tensor_sizes"] = sizes
        post("/update_weights", {"update_info": info})

    post("/init_weight_transfer_engine", {"init_info": {"packed": args["packed"]}})
    post("/start_weight_update")
    keep: list[torch.Tensor] = []
    if not args["packed"]:
        handles = []
        for _, t in tensors:
            w = t.detach().contiguous()
            keep.append(w)
            handles.append({uuid: reduce_tensor(w)[1]})
        update(tensors, handles)
    else:
        size = 2 * max(t.numel() * t.element_size() for _, t in tensors)
        buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        buffer_args = reduce_tensor(buffer)[1]
        chunk: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, t in tensors:
            flat = t.contiguous().view(-1).view(torch.uint8)
            if used and used + flat.numel() > size:
                torch.cuda.synchronize()
                update(chunk, {uuid: buffer_args}, [x.numel() * x.element_size()
                                                    for _, x in chunk])
                chunk, used = [], 0
            buffer[used:used + flat.numel()].copy_(flat)
            chunk.append((name, t))
            used += flat.numel()
        torch.cuda.synchronize()
        update(chunk, {uuid: buffer_args}, [x.numel() * x.element_size() for _, x in chunk])
    post("/finish_weight_update", {"weight_version": "ipc"})
    del keep
    torch.cuda.ipc_collect()
    print("synced")


if __name__ == "__main__":
    main()
