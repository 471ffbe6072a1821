"""The prefill-decode disaggregation flags of ``EngineConfig`` (SGLang's names), checked here.

    disaggregation_mode              "null" (a whole server), "prefill" or "decode"
    disaggregation_bootstrap_port    the prefill server's port decode servers fetch KV from
    disaggregation_transfer_backend  how KV moves: "auto" (shared memory when both servers
                                     share a host, TCP otherwise), "shm", "tcp"; SGLang's
                                     "mooncake" and "nixl" mean "auto" here
    disaggregation_transfer_timeout  ours: seconds a decode server waits for a room's KV, and
                                     a prefill server keeps KV no decode server fetched

Not combined with a role (refused naming the flag): tensor or data parallelism, speculative
decoding, LoRA adapters, recorded expert routing (their state does not travel with the KV yet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["check_disaggregation", "MODES", "TRANSFER_BACKENDS"]

MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("auto", "shm", "tcp", "mooncake", "nixl")


def check_disaggregation(cfg: Any, bad: Callable[[str, str], None]) -> None:
    mode = cfg.disaggregation_mode
    if mode not in MODES:
        bad("disaggregation_mode", f"must be one of {list(MODES)}, got {mode!r}")
    if cfg.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        bad("disaggregation_transfer_backend", f"must be one of {list(TRANSFER_BACKENDS)}, "
            f"got {cfg.disaggregation_transfer_backend!r}")
    port = cfg.disaggregation_bootstrap_port
    if not 0 <= port <= 65535:
        bad("disaggregation_bootstrap_port", f"must be a TCP port (0: any free), got {port}")
    if not cfg.disaggregation_transfer_timeout > 0:
        bad("disaggregation_transfer_timeout",
            f"must be > 0 seconds, got {cfg.disaggregation_transfer_timeout}")
    if mode == "null":
        return
    for name, on in (("tp_size", cfg.tp_size > 1), ("dp_size", cfg.dp_size > 1),
                     ("speculative_algorithm", cfg.speculative_algorithm is not None),
                     ("enable_lora", cfg.enable_lora or bool(cfg.lora_paths)),
                     ("enable_return_routed_experts", cfg.enable_return_routed_experts)):
        if on:
            bad(name, f"is not combined with --disaggregation-mode {mode} (run one prefill and "
                "one decode server per replica behind the PD router)")
