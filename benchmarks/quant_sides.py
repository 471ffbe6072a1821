"""The sides ``bench_quant.py`` compares, its table, and vLLM's script.

A side is named on the command line (``--sides``):

    float32      ours, float32 weights and activations
    bfloat16     ours, bfloat16 (unquantized)
    w8a8_int8    ours, ``--quantization w8a8_int8`` (float32 elsewhere)
    fp8          ours, ``--quantization fp8`` (float32 elsewhere)
    vllm:w8a8    vLLM's CPU build on the compressed-tensors int8 W8A8 copy of the model
                 (``testing/quantized_checkpoint.write_quantized``), float32 elsewhere
    vllm:float32 / vllm:bfloat16   vLLM's CPU build on the unquantized directory

No engine is imported here: the pure helpers are tested without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["DEFAULT_SIDES", "RATIOS", "Side", "VLLM_SCRIPT", "best_of", "parse_sides",
           "ratio_rows", "tok_s_rows"]


@dataclass(frozen=True)
class Side:
    """One engine configuration: ``engine`` "ours" or "vllm", the model's ``dtype``, and the
    ``quantization`` (None: unquantized)."""

    name: str
    engine: str
    dtype: str
    quantization: Optional[str]


_KNOWN: dict[str, Side] = {s.name: s for s in (
    Side("float32", "ours", "float32", None),
    Side("bfloat16", "ours", "bfloat16", None),
    Side("w8a8_int8", "ours", "float32", "w8a8_int8"),
    Side("fp8", "ours", "float32", "fp8"),
    Side("vllm:w8a8", "vllm", "float32", "w8a8_int8"),
    Side("vllm:float32", "vllm", "float32", None),
    Side("vllm:bfloat16", "vllm", "bfloat16", None),
)}

DEFAULT_SIDES = "float32,bfloat16,w8a8_int8,vllm:w8a8,vllm:float32"

# (numerator, denominator) side names of the ratio columns, each shown when both ran
RATIOS: tuple[tuple[str, str], ...] = (
    ("w8a8_int8", "float32"), ("w8a8_int8", "bfloat16"), ("w8a8_int8", "vllm:w8a8"),
    ("float32", "vllm:float32"), ("vllm:w8a8", "vllm:float32"), ("fp8", "float32"),
)


def parse_sides(text: str) -> list[Side]:
    """``"float32,vllm:w8a8"`` -> the sides in that order; ValueError naming an unknown or
    repeated side, or an empty list."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--sides: no side named; choose from " + ", ".join(_KNOWN))
    unknown = [n for n in names if n not in _KNOWN]
    if unknown:
        raise ValueError(f"--sides: unknown side(s) {', '.join(unknown)}; choose from "
                         + ", ".join(_KNOWN))
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--sides: side(s) named twice: {', '.join(repeated)}")
    return [_KNOWN[n] for n in names]


def best_of(a: Optional[dict[str, Any]], b: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Two rounds' results of one side merged: the higher tok/s per batch, the lower refit
    seconds; the other fields are the first's."""
    if a is None or b is None:
        return a or b
    out = {**a, "tok_s": {k: max(a["tok_s"][k], b["tok_s"][k]) for k in a["tok_s"]}}
    if a.get("refit_s") is not None and b.get("refit_s") is not None:
        out["refit_s"] = min(a["refit_s"], b["refit_s"])
    return out


def tok_s_rows(best: dict[str, Optional[dict[str, Any]]], sides: list[Side],
               batches: list[int]) -> tuple[list[str], list[list[Any]]]:
    """The tok/s table: a row per batch, a column per side ("-" where a side gave nothing)."""
    header = ["batch"] + [f"{s.name} tok/s" for s in sides]
    rows = [[b] + [best[s.name]["tok_s"][str(b)] if best.get(s.name) else "-" for s in sides]
            for b in batches]
    return header, rows


def ratio_rows(best: dict[str, Optional[dict[str, Any]]],
               batches: list[int]) -> tuple[list[str], list[list[Any]]]:
    """The ratio table: a row per batch, a column per ``RATIOS`` pair whose sides both ran."""
    pairs = [(a, b) for a, b in RATIOS if best.get(a) and best.get(b)]
    header = ["batch"] + [f"{a} / {b}" for a, b in pairs]
    rows = [[batch] + [best[a]["tok_s"][str(batch)] / best[b]["tok_s"][str(batch)]  # type: ignore[index]
                       for a, b in pairs] for batch in batches]
    return header, rows


# vLLM's side runs under vLLM's interpreter: no import of this project there. It records what
# vLLM made of the checkpoint: the config's quantization and the first layer's qkv linear's
# quant method, scheme and kernel (an unquantized load shows UnquantizedLinearMethod).
VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
import torch

def make_prompts(num, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (num, length), generator=g).tolist()

def probe(model):
    lin = model.model.layers[0].self_attn.qkv_proj
    scheme = getattr(lin, "scheme", None)
    kernel = getattr(scheme, "kernel", None)
    method = getattr(kernel, "linear_method", None)
    return {"quant_method": type(lin.quant_method).__name__,
            "scheme": type(scheme).__name__ if scheme is not None else None,
            "kernel": type(kernel).__name__ if kernel is not None else None,
            "kernel_path": getattr(method, "__name__", None)}

def main():
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    n, new, plen, biggest = spec["n"], spec["new_tokens"], spec["prompt_len"], max(spec["batches"])
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], enable_prefix_caching=True,
              max_num_seqs=max(64, biggest), seed=0, max_model_len=plen + new + 64)
    loaded = {"config_quantization": llm.llm_engine.model_config.quantization,
              **llm.apply_model(probe)[0]}
    print("LOADED " + json.dumps(loaded), flush=True)
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0)
    tok_s = {}
    for i, batch in enumerate(spec["batches"]):
        prompts = [TokensPrompt(prompt_token_ids=p)
                   for p in make_prompts(batch // n, plen, spec["vocab"], i)]
        warm = [TokensPrompt(prompt_token_ids=p)
                for p in make_prompts(batch // n, plen, spec["vocab"], 1000 + i)]
        llm.generate(warm, SamplingParams(n=n, temperature=1.0, max_tokens=4, ignore_eos=True,
                                          logprobs=0), use_tqdm=False)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        toks = [len(c.token_ids) for o in outs for c in o.outputs]
        assert len(toks) == batch and all(t == new for t in toks), toks[:4]
        assert all(len(c.logprobs) == new for o in outs for c in o.outputs)
        tok_s[str(batch)] = batch * new / wall
    print("RESULT " + json.dumps({"tok_s": tok_s, "refit_s": None, "loaded": loaded}), flush=True)

if __name__ == "__main__":
    main()
"""
