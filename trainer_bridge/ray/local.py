"""A light single-node Ray for one machine (tests, examples, a laptop): every address 127.0.0.1.

Ray replaces 127.0.0.1 by the address of the host's network interface unless its single-node
switch (``LOCAL_ONLY_ENV``) is "0" when ray is imported; `start_local_ray` sets it, and refuses
a ray imported earlier without it before starting anything.
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["LOCAL_ONLY_ENV", "start_local_ray"]

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's single-node switch, read when ray is imported: "0" makes its node address 127.0.0.1
(otherwise Ray replaces 127.0.0.1 by the address of the host's network interface)."""


def start_local_ray(num_cpus: int, num_gpus: Optional[int] = None,
                    object_store_bytes: int = 100 << 20, temp_dir: Optional[str] = None) -> Any:
    """Start a light single-node Ray on 127.0.0.1: no dashboard, usage stats off (it reaches
    nothing beyond this host), a small object store (weights never go through it). Ray must
    not have been imported yet, or have been imported with ``LOCAL_ONLY_ENV=0`` set; otherwise
    it would use the host's interface address, and this raises RuntimeError saying so."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    import ray
    from ray._private import ray_constants

    wrong = f"set {LOCAL_ONLY_ENV}=0 before importing ray (it was imported before start_local_ray)"
    if getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):   # checked before anything starts
        raise RuntimeError(f"Ray would start on this host's interface address: {wrong}")
    context = ray.init(num_cpus=num_cpus, num_gpus=num_gpus,
                       object_store_memory=object_store_bytes, include_dashboard=False,
                       _node_ip_address="127.0.0.1", _temp_dir=temp_dir, configure_logging=False,
                       log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    if not address.startswith("127."):
        ray.shutdown()
        raise RuntimeError(f"Ray started on {address}, not 127.0.0.1: {wrong}")
    return context
