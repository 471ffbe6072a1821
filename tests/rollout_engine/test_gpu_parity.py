"""The CUDA path in bf16 against transformers in bf16, and CUDA graphs across sleep / wake / refit.

Tolerances are those of ``rollout_engine.testing.parity``: greedy tokens equal up to the first
step where transformers' own top-2 logit gap is <= 0.05; returned logprobs (teacher-forced
through transformers on our tokens) within 0.1 max and 0.02 mean.
"""

from __future__ import annotations

import pytest
import torch

from rollout_engine.testing.parity import GPU_TINY_SIZES, engine_vs_hf, load_hf
from rollout_engine.testing.tiny_model import tiny_model_path
from tests.conftest import ARCHS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_NEW = 16
PROMPT_LENS = [3, 17, 64, 150, 5, 33, 90, 240]


@pytest.fixture(scope="module")
def gpu_paths() -> dict[str, str]:
    return {arch: str(tiny_model_path(arch, **GPU_TINY_SIZES)) for arch in ARCHS}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from a cold cache (a cached prefix would change bf16 rounding)."""
    engine.flush_cache()
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0,
                                                               "max_new_tokens": MAX_NEW})
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("flags", [{}, {"attention_backend": "triton"},
                                   {"disable_cuda_graph": True}],
                         ids=["default", "triton", "eager"])
def test_bf16_parity_with_transformers(arch, flags, gpu_paths, make_engine):
    path = gpu_paths[arch]
    engine = make_engine(path, device="cuda", dtype="bfloat16", max_total_tokens=8192, **flags)
    hf = load_hf(path, torch.bfloat16, "cuda")
    reports = engine_vs_hf(engine, hf, _prompts(engine.tm.vocab_size), MAX_NEW)
    for i, report in enumerate(reports):
        assert report.ok, f"prompt {i} (len {PROMPT_LENS[i]}): {report}"
    # the near-tie rule must leave most tokens compared, or the test proves nothing
    assert sum(r.compared_tokens for r in reports) >= 0.5 * len(reports) * MAX_NEW


def test_graphs_survive_sleep_wake_and_refit(gpu_paths, make_engine):
    path = gpu_paths["qwen2"]
    # triton: eager decode runs the same kernel as the graphs, so tokens must match exactly
    engine = make_engine(path, device="cuda", dtype="bfloat16", max_total_tokens=8192,
                         enable_weights_cpu_backup=True, attention_backend="triton")
    prompts = _prompts(engine.tm.vocab_size, seed=1)[:4]
    before = _greedy(engine, prompts)
    free0 = torch.cuda.mem_get_info()[0]
    engine.release_memory_occupation()        # weights, KV and graphs (thread mode: same GPU)
    assert torch.cuda.mem_get_info()[0] > free0
    engine.resume_memory_occupation()
    assert _greedy(engine, prompts) == before  # recaptured over the new buffers
    ok, msg = engine.update_weights_from_disk(path)
    assert ok, msg
    assert _greedy(engine, prompts) == before  # refit copies in place: graphs stay valid
    engine.release_memory_occupation(["cuda_graph"])
    assert _greedy(engine, prompts) == before  # eager while the graphs are released
    engine.resume_memory_occupation(["cuda_graph"])
    assert _greedy(engine, prompts) == before
