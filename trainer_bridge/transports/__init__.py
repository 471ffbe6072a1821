"""Weight transports: how a trainer's tensors reach the engines (see base.WeightTransport)."""

from trainer_bridge.transports.base import WeightSyncError, WeightTransport
from trainer_bridge.transports.disk import DiskTransport
from trainer_bridge.transports.distributed import DistributedTransport
from trainer_bridge.transports.tensor import TensorTransport

__all__ = [
    "DiskTransport",
    "DistributedTransport",
    "TensorTransport",
    "WeightSyncError",
    "WeightTransport",
]
