"""Run by the python of a vLLM (CPU build) environment: one token per request with
``logprobs_mode="processed_logprobs"``; prints, per request, the top candidates of that
position as ``[[token_id, logprob], ...]`` (JSON on the last stdout line).

argv[1]: a JSON file ``{"model": dir, "num": N, "requests": [{"prompt": [ids], "params":
{vLLM SamplingParams fields}}, ...]}``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=spec["model"], dtype="float32", logprobs_mode="processed_logprobs",
              max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=8)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in spec["requests"]]
    params = [SamplingParams(max_tokens=1, logprobs=spec["num"], **r["params"])
              for r in spec["requests"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for out in outputs:
        step = out.outputs[0].logprobs[0]
        rows.append(sorted([[int(t), float(lp.logprob)] for t, lp in step.items()],
                           key=lambda e: (-e[1], e[0])))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
