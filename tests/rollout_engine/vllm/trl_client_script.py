"""Runs TRL 1.16's own ``VLLMClient`` against a server, in the TRL virtual environment.

    python trl_client_script.py '<json spec>'   -> prints one JSON object

spec: ``url``, ``prompts`` (texts), ``messages`` (conversations), ``max_tokens``, and for a
weight sync ``model_path``, ``save_to``, ``group_port``, ``seed``. Every call is the client's
public method, unchanged; only ``vllm`` is the CPU stand-in (trl_vllm_standin.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def generation(client: Any, spec: dict[str, Any]) -> dict[str, Any]:
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    scored = client.generate(prompts, temperature=0.0, max_tokens=max_tokens)
    sequences = [p + c for p, c in zip(scored["prompt_ids"], scored["completion_ids"])]
    return {
        "scored": {"sequences": sequences, "prompt_lengths": [len(p) for p in
                                                              scored["prompt_ids"]]},
        "sequence_logprobs": client.get_sequence_logprobs(
            sequences, [len(p) for p in scored["prompt_ids"]], top_logprobs=3),
        "world_size": client.get_world_size(),
        "weight_transfer_config": client.get_server_info()["weight_transfer_config"],
        "greedy": client.generate(prompts, n=2, temperature=0.0, max_tokens=max_tokens,
                                  logprobs=0),
        "sampled": client.generate(prompts, n=3, temperature=1.0, top_p=0.9, top_k=50,
                                   min_p=0.01, repetition_penalty=1.1, max_tokens=max_tokens,
                                   logprobs=2, generation_kwargs={"seed": 7}),
        "token_prompts": client.generate([[1, 2, 3, 4]], temperature=0.0, max_tokens=max_tokens,
                                         logprobs=None),
        "regex": client.generate(prompts[:1], temperature=1.0, max_tokens=max_tokens,
                                 structured_outputs_regex="[0-9]{3}"),
        "chat": client.chat(spec["messages"], n=2, temperature=0.0, max_tokens=max_tokens),
        "cached_before_reset": cached_tokens(client),
        "reset_prefix_cache": client.reset_prefix_cache(),
        "cached_after_reset": cached_tokens(client),
    }


def cached_tokens(client: Any) -> int:
    """The server's prefix-cache size (SGLang's key of the shared /server_info answer)."""
    return client.session.get(f"{client.base_url}/server_info").json()["kv_cached_tokens"]


def weight_sync(client: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(spec["save_to"])
    # The client refuses a non-CUDA device by name; the stand-in's group runs gloo on CPU
    # tensors, and "cuda" without an index makes the client call no CUDA function.
    client.init_communicator(device="cuda")
    client.update_model_params(model)
    with client.weight_update():   # the grouped form: start once, several tensors, finish once
        for name, param in list(model.named_parameters())[:2]:
            client.update_named_param(name, param.data)
    after = client.generate(spec["prompts"], temperature=0.0, max_tokens=spec["max_tokens"])
    client.close_communicator()
    return {"after": after, "names": [name for name, _ in model.named_parameters()]}


def main() -> None:
    from trl.generation.vllm_client import VLLMClient

    spec = json.loads(sys.argv[1])
    client = VLLMClient(base_url=spec["url"], group_port=spec.get("group_port", 51216),
                        connection_timeout=30)
    result = weight_sync(client, spec) if spec.get("save_to") else generation(client, spec)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
