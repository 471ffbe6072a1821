"""Run in vLLM's venv: vLLM's side of its NCCL rendezvous, up to the communicator (no CUDA here).

argv[1] "encode": read a pickle our encode_unique_id wrote (stdin, hex), print the id vLLM
unpickles (hex). argv[1] "host PORT ID_HEX": host a StatelessProcessGroup as rank 0 of 2 and
publish ID_HEX as vLLM's trainer publishes its NCCL unique id, then wait for rank 1.
"""

import pickle
import sys

from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
from vllm.distributed.utils import StatelessProcessGroup

if sys.argv[1] == "encode":
    uid = pickle.loads(bytes.fromhex(sys.stdin.read().strip()))
    assert isinstance(uid, ncclUniqueId)
    print(bytes(uid.internal).hex())
else:
    port, raw = int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    uid = ncclUniqueId()
    for i, b in enumerate(raw):
        uid.internal[i] = b - 256 if b > 127 else b
    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=2)
    pg.broadcast_obj(uid, src=0)
    print("published", flush=True)
    pg.store.wait(["rank1_read"])   # keep the store up until rank 1 has read the id
