"""Tests for the deterministic tiny-model generator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_engine.testing.tiny_model import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    LLAMA3_ROPE_SCALING,
    PAD_TOKEN_ID,
    PRESET_55M,
    make_tiny_model,
    tiny_model_path,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
ARCH_CASES = {
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "llama": dict(arch="llama"),
    "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE_SCALING),
}
TEXTS = [
    "Hello, world! 12+34=46",
    "def f(x):\n    return x * 2\n\n\tindent  trailing  ",
    "東京は日本の首都です。北京 学生 🚀😀👍🏽 naïve café ½ → ✓",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    # Tiny matmuls gain nothing from threads, and on a busy 2-core machine OpenMP spin-waiting
    # made them ~40x slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def load_model(path: Path) -> AutoModelForCausalLM:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing/unexpected/mismatched keys or errors
    return model.eval()


def safetensors_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys.update(f.keys())
    return keys


@torch.no_grad()
def logits_for(model, num_prompts: int = 20, prompt_len: int = 10) -> torch.Tensor:
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(5, model.config.vocab_size, (num_prompts, prompt_len), generator=gen)
    return model(ids).logits


@pytest.mark.parametrize("case", ARCH_CASES)
def test_arch_loads_in_transformers_with_arch_features(case):
    spec = ARCH_CASES[case]
    path = tiny_model_path(**spec)
    model = load_model(path)
    params = dict(model.named_parameters())
    config = json.loads((path / "config.json").read_text())
    assert config["rope_theta"] == 10000.0
    assert config["rope_scaling"] == spec.get("rope_scaling")
    if case == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in params
    if case == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in params
        assert config["head_dim"] == 16
    if case == "llama3_rope":
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert model.config.rope_parameters["original_max_position_embeddings"] == 256
    assert model.config.vocab_size == 512
    assert len(AutoTokenizer.from_pretrained(path)) == 512


def test_llama3_rope_scaling_changes_outputs_at_short_lengths():
    scaled = load_model(tiny_model_path("llama", rope_scaling=LLAMA3_ROPE_SCALING))
    plain = load_model(tiny_model_path("llama"))
    # Weights do not depend on rope settings, so any difference is the scaling itself.
    assert torch.equal(scaled.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert (logits_for(scaled, 4, 32) - logits_for(plain, 4, 32)).abs().max() > 1e-2


def test_same_args_give_identical_bytes_and_cli_matches_api(tmp_path):
    api_dir = make_tiny_model(tmp_path / "api", "qwen3", seed=3)
    # A second process catches per-process randomness (hash seeds, thread scheduling).
    cli = [sys.executable, "-m", "rollout_engine.testing.tiny_model", str(tmp_path / "cli")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([*cli, "--arch", "qwen3", "--seed", "3"], check=True, env=env, cwd=REPO_ROOT)
    names = sorted(p.name for p in api_dir.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli").iterdir())
    for name in names:
        assert (api_dir / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name

    # The seed moves the weights only; the tokenizer depends on vocab_size alone.
    seed0 = tiny_model_path("qwen3")
    assert (seed0 / "model.safetensors").read_bytes() != (
        api_dir / "model.safetensors"
    ).read_bytes()
    assert (seed0 / "tokenizer.json").read_bytes() == (api_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tokenizer_round_trips_utf8_and_matches_raw_tokenizers(arch):
    path = tiny_model_path(arch)
    tok = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids
        assert max(ids, default=0) < 512
        assert tok.decode(ids) == text
    # Decomposed accents come back composed: the pipeline normalizes to NFC like Qwen's.
    decomposed = "e\u0301te\u0301"
    assert tok.decode(tok.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)


def test_special_tokens_and_chat_template():
    path = tiny_model_path("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        PAD_TOKEN_ID,
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    )
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [
        IM_START_TOKEN_ID,
        IM_END_TOKEN_ID,
    ]
    assert tok.unk_token is None and len(tok) == 512
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
            PAD_TOKEN_ID,
            BOS_TOKEN_ID,
            EOS_TOKEN_ID,
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(IM_START_TOKEN_ID) == 3 and ids.count(IM_END_TOKEN_ID) == 2


def test_vocab_padding_when_corpus_runs_out_of_merges():
    path = tiny_model_path("llama", hidden_size=32, num_layers=1, vocab_size=34_000)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 34_000
    assert tok.convert_ids_to_tokens(33_999).startswith("<|extra_")
    assert tok.decode(tok.encode("日本 🚀 abc")) == "日本 🚀 abc"


def test_sharded_checkpoint_loads_and_matches_unsharded():
    sharded_path = tiny_model_path("llama", shard_size_mb=0.1)
    shards = sorted(sharded_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (sharded_path / "model.safetensors").exists()
    index = json.loads((sharded_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(
        p.numel() * p.element_size() for p in load_model(sharded_path).parameters()
    )
    unsharded = load_model(tiny_model_path("llama"))
    assert torch.equal(logits_for(load_model(sharded_path)), logits_for(unsharded))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_margins_are_far_above_float_noise(arch):
    model = load_model(tiny_model_path(arch))
    logits = logits_for(model)  # 200 positions
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.numel() == 200
    assert gaps.median() > 0.1, f"median top-1/top-2 gap {gaps.median():.4f}"
    assert (gaps < 1e-4).sum() <= 1
    assert 1.0 < logits.std(dim=-1).mean() < 10.0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@torch.no_grad()
def test_greedy_generation_does_not_collapse(arch):
    model = load_model(tiny_model_path(arch))
    ids = torch.randint(5, 512, (8, 5), generator=torch.Generator().manual_seed(7))
    for _ in range(24):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    generated = ids[:, 5:]
    assert len(set(generated.flatten().tolist())) >= 16
    assert sum(len(set(row.tolist())) > 1 for row in generated) >= 6


def test_tied_and_untied_embeddings():
    cases = {
        ("qwen2", None): True,
        ("qwen3", None): True,
        ("llama", None): False,
        ("qwen2", False): False,
        ("llama", True): True,
    }
    for (arch, tie), expected in cases.items():
        path = tiny_model_path(arch, tie_word_embeddings=tie)
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is expected
        assert ("lm_head.weight" in safetensors_keys(path)) is (not expected)
        model = load_model(path)
        shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert shared is expected, (arch, tie)


def test_cache_builds_once_and_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    with ThreadPoolExecutor(2) as pool:  # two concurrent builders of the same model
        paths = list(pool.map(lambda _: tiny_model_path("qwen3", num_layers=1, seed=5), range(2)))
    assert paths[0] == paths[1] and paths[0].parent == tmp_path / "tiny_models"
    assert [p.name for p in (tmp_path / "tiny_models").iterdir()] == [paths[0].name]  # no temp dirs
    mtime = (paths[0] / "model.safetensors").stat().st_mtime_ns
    # Explicit defaults resolve to the same key, and a hit does not rebuild.
    same = tiny_model_path("qwen3", num_layers=1, seed=5, hidden_size=64, init_std=None)
    assert same == paths[0] and (same / "model.safetensors").stat().st_mtime_ns == mtime
    assert tiny_model_path("qwen3", num_layers=1, seed=6) != paths[0]
    load_model(paths[0])


def test_invalid_arguments_raise_with_field_names(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "a", "gpt2")
    with pytest.raises(ValueError, match="num_heads"):
        make_tiny_model(tmp_path / "b", hidden_size=60, num_heads=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path / "c", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "d", vocab_size=100)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny_model(tmp_path / "e")


@pytest.mark.slow
def test_preset_55m_loads_with_clear_greedy_margins():
    model = load_model(tiny_model_path("llama", **PRESET_55M))
    assert 50e6 < sum(p.numel() for p in model.parameters()) < 60e6
    top2 = logits_for(model).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.1
