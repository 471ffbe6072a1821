"""bench_lora's vLLM column: vLLM's CPU build with the same adapter directories, in its own venv
(``vllm_peer.py``). Its LoRA support on CPU is whatever that build does: an error at any stage
is recorded verbatim (``"error"``) instead of a number."""

from __future__ import annotations

from typing import Any, Optional

from benchmarks import vllm_peer

# runs under vLLM's interpreter: no import of this project there
VLLM_SCRIPT = r"""
import json, sys, time, traceback

def main():
    spec = json.loads(sys.argv[1])
    out = {}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        out["vllm"] = vllm.__version__
        llm = LLM(model=spec["model_dir"], dtype="float32", enable_lora=True,
                  max_lora_rank=spec["max_lora_rank"], max_loras=len(spec["adapters"]),
                  enable_prefix_caching=True, max_num_seqs=256, seed=0,
                  max_model_len=spec["prompt_len"] + spec["new_tokens"] + 64)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
        print("RESULT " + json.dumps(out), flush=True)
        return
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    n, new = spec["n"], spec["new_tokens"]
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0)
    reqs = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    mixed = [reqs[i % len(reqs)] for i in range(len(prompts))]

    def run(lora):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        wall = time.perf_counter() - t0
        toks = [len(c.token_ids) for o in outs for c in o.outputs]
        assert all(t == new for t in toks) and len(toks) == n * len(prompts), toks[:4]
        return len(toks) * new / wall

    try:
        run(None)
        run(mixed)     # warm-up: every adapter loaded once
        out["base_tok_s"], out["lora_tok_s"] = [], []
        for _ in range(spec["repeats"]):
            out["base_tok_s"].append(run(None))
            out["lora_tok_s"].append(run(mixed))
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
        print("RESULT " + json.dumps(out), flush=True)
        return
    # an adapter's (re)load: a new id for the same directory, as a trainer's new step would be
    out["add_lora_seconds"] = {}
    next_id = 100
    for rank, path in spec["refit_adapters"].items():
        secs = []
        try:
            for _ in range(spec["repeats"]):
                next_id += 1
                t0 = time.perf_counter()
                llm.llm_engine.add_lora(LoRARequest(f"r{rank}-{next_id}", next_id, path))
                secs.append(time.perf_counter() - t0)
                llm.llm_engine.remove_lora(next_id)
            out["add_lora_seconds"][rank] = secs
        except Exception as e:
            out["add_lora_seconds"][rank] = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out), flush=True)

main()
"""


def vllm_lora(spec: dict[str, Any], setup: bool) -> dict[str, Any]:
    """vLLM's figures for ``spec`` (model_dir, adapters, prompts, ...), its error verbatim, or
    why it did not run."""
    py = vllm_peer.vllm_python(setup=setup)
    if py is None:
        return {"error": "no vLLM venv (benchmarks/vllm_peer.py)"}
    res: Optional[dict[str, Any]] = vllm_peer.run_vllm_script(py, VLLM_SCRIPT, spec,
                                                              timeout=3600)
    return res if res is not None else {"error": "the vLLM run printed no result (see above)"}
