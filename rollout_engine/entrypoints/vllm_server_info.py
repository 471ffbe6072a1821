"""vLLM's ``/server_info`` view of this server: the ``vllm_config`` tree that vLLM's dev route
answers, built from our own server info.

vLLM answers ``GET /server_info?config_format=json|text`` with ``{"vllm_config": ...}`` (the
``VllmConfig`` as a JSON tree, or its ``str``). The SGLang route of the same name answers a flat
dict of server flags; one handler serves both by adding the ``vllm_config`` key to that dict
(SGLang's readers ignore keys they do not know). Only the parts a client reads are mirrored:
TRL's ``VLLMClient.init_communicator`` refuses to sync weights when
``vllm_config["weight_transfer_config"]`` is null, so it names the backend this server's
weight-transfer routes use.
"""

from __future__ import annotations

import json
from typing import Any, Literal

__all__ = ["CONFIG_FORMATS", "vllm_config"]

CONFIG_FORMATS = ("text", "json")


def weight_transfer_backend(device: str) -> str:
    """The collective backend the trainer's weight-transfer group runs on for ``device``: NCCL
    on CUDA (vLLM's ``{"backend": "nccl"}``); on CPU the same broadcasts run over gloo."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _tree(info: dict[str, Any]) -> dict[str, Any]:
    tp, dp = int(info.get("tp_size") or 1), int(info.get("dp_size") or 1)
    model = info["model_path"]
    return {
        "model_config": {
            "model": model,
            "tokenizer": info.get("tokenizer_path") or model,
            "served_model_name": info.get("served_model_name") or model,
            "dtype": info.get("dtype"),
            "max_model_len": info.get("context_length"),
            "logprobs_mode": info.get("logprobs_mode"),
        },
        "parallel_config": {
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": 1,
            "data_parallel_size": dp,
            "world_size": tp,
            "world_size_across_dp": tp * dp,
        },
        "cache_config": {"enable_prefix_caching": not info.get("disable_radix_cache", False)},
        "device_config": {"device": info.get("device")},
        "weight_transfer_config": {"backend": weight_transfer_backend(info.get("device", ""))},
    }


def vllm_config(info: dict[str, Any], config_format: Literal["text", "json"]) -> Any:
    """``info`` (``Engine.get_server_info()``) as vLLM's ``vllm_config``: a JSON tree for
    ``"json"``, one line of text for ``"text"``. Raises ValueError for another format."""
    if config_format not in CONFIG_FORMATS:
        raise ValueError(f"config_format must be one of {list(CONFIG_FORMATS)}, "
                         f"got {config_format!r}")
    tree = _tree(info)
    if config_format == "json":
        return tree
    return ", ".join(f"{section}={json.dumps(value, sort_keys=True)}"
                     for section, value in tree.items())
