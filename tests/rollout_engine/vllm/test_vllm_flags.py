"""``vllm serve``'s command line: the table covers every flag of vLLM 0.32's parser (the list in
data/vllm_serve_flags.json, written by data/dump_vllm_flags.py), each flag parses as vLLM
parses it, and is mapped, ignored or refused by name as the table says."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_engine.compat.vllm_args import (
    IGNORED,
    UNSUPPORTED,
    VLLM_FLAGS,
    VLLM_VERSION,
    human_readable_int,
    markdown,
    normalize_argv,
)
from rollout_engine.compat.vllm_special import SPECIAL
from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints import cli, vllm_serve

DATA = json.loads((Path(__file__).parent / "data" / "vllm_serve_flags.json").read_text())
VLLM_ROWS = {row["dest"]: row for row in DATA["flags"]}
FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
OUR_ACTIONS = {a.dest: a for a in vllm_serve.build_parser()._actions}


def parse(*argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return vllm_serve.parse_args(["/models/m", *argv], env=env or {})


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# -- the table against vLLM's parser ------------------------------------------------------------
def test_every_vllm_flag_is_classified() -> None:
    assert DATA["vllm_version"] == VLLM_VERSION
    assert len(VLLM_ROWS) > 300
    assert sorted(set(VLLM_ROWS) - set(VLLM_FLAGS)) == []     # a vLLM flag on no row
    assert sorted(set(VLLM_FLAGS) - set(VLLM_ROWS)) == []     # a row vLLM does not have


@pytest.mark.parametrize("dest", sorted(VLLM_ROWS))
def test_row_parses_like_vllm(dest: str) -> None:
    """Same kind (switch, bool, int, size, json, list, ...) and every option string vLLM has,
    ``--no-x`` of a bool among them."""
    row, flag = VLLM_ROWS[dest], VLLM_FLAGS[dest]
    assert flag.kind == row["kind"]
    assert sorted(OUR_ACTIONS[dest].option_strings) == sorted(row["options"])


def test_every_treatment_has_its_reason_or_field() -> None:
    for name, flag in VLLM_FLAGS.items():
        if flag.treatment == "ours":
            assert flag.detail in FIELDS, name
        elif flag.treatment == "special":
            assert name in SPECIAL, name
        elif flag.treatment == "ignore":
            assert flag.detail in IGNORED, name
        else:
            assert flag.treatment == "default" and flag.detail in UNSUPPORTED, name


def test_table_is_documented() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "VLLM_CLI.md").read_text()
    assert markdown() in doc, "docs/VLLM_CLI.md: regenerate from vllm_args.markdown()"
    assert "VLLM_CLI.md" in (Path(__file__).parents[3] / "docs" / "API.md").read_text()


# -- mapped flags ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--port", "9001", "--host", "127.0.0.1"], {"port": 9001, "host": "127.0.0.1"}),
    (["--max-model-len", "256"], {"context_length": 256}),
    (["--max-model-len", "32k"], {"context_length": 32000}),
    (["--max-model-len", "1K"], {"context_length": 1024}),
    (["--max_model_len", "auto"], {}),
    (["--served-model-name", "foo"], {"served_model_name": "foo"}),
    (["--api-key", "sk"], {"api_key": "sk"}),
    (["-tp", "2", "-dp", "3"], {"tp_size": 2, "dp_size": 3}),
    (["--tensor-parallel-size", "2", "--data-parallel-size", "2"], {"tp_size": 2, "dp_size": 2}),
    (["--max-num-seqs", "8"], {"max_running_requests": 8}),
    (["--max-num-batched-tokens", "4k"], {"chunked_prefill_size": 4000,
                                          "max_prefill_tokens": 4000}),
    (["--enable-sleep-mode"], {"enable_memory_saver": True}),
    (["--logprobs-mode", "processed_logprobs"], {"logprobs_mode": "processed_logprobs"}),
    (["--no-enable-prefix-caching"], {"disable_radix_cache": True}),
    (["--enable-prefix-caching"], {"disable_radix_cache": False}),
    (["--dtype", "half", "--seed", "7"], {"dtype": "float16", "random_seed": 7}),
    (["--gpu-memory-utilization", "0.5"], {"mem_fraction_static": 0.5}),
    (["--device-memory-utilization", "0.5"], {"mem_fraction_static": 0.5}),
    (["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "6"],
     {"enable_lora": True, "max_loras_per_batch": 4, "max_lora_rank": 32,
      "max_loaded_loras": 6, "lora_target_modules": ["all"]}),
    (["--enable-lora"], {"enable_lora": True, "max_lora_rank": 16,
                         "lora_target_modules": ["all"]}),
    (["--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'],
     {"enable_lora": True, "lora_paths": [{"lora_name": "a", "lora_path": "/x"},
                                          {"lora_name": "b", "lora_path": "/y"}]}),
    (["--enable-return-routed-experts"], {"enable_return_routed_experts": True}),
    (["--aux-output-config", '{"enable_return_routed_experts": true}'],
     {"enable_return_routed_experts": True}),
    (["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"],
     {"tool_call_parser": "llama3"}),
    (["--tool-call-parser", "hermes"], {"tool_call_parser": "hermes"}),
    (["--reasoning-parser", "deepseek_r1"], {"reasoning_parser": "deepseek-r1"}),
    (["--generation-config", "vllm"], {"sampling_defaults": "openai"}),
    (["--generation-config", "auto"], {"sampling_defaults": "model"}),
    (["--trust-remote-code", "--enforce-eager"], {"disable_cuda_graph": True}),
    (["--kv-cache-dtype", "bfloat16"], {"kv_cache_dtype": "bfloat16"}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'],
     {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
      "speculative_ngram_min_match_window_size": 2,
      "speculative_ngram_max_match_window_size": 4}),
    (["--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens",
      "2"], {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3,
             "speculative_ngram_min_match_window_size": 5,
             "speculative_ngram_max_match_window_size": 5}),
    (["--spec-model", "/models/draft", "--spec-tokens", "4"],
     {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/models/draft",
      "speculative_num_draft_tokens": 5}),
    (["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
     {"grammar_backend": "xgrammar", "constrained_json_disable_any_whitespace": True}),
    (["--block-size", "16", "--num-gpu-blocks-override", "10"],
     {"page_size": 16, "max_total_tokens": 160}),
    (["--max-logprobs", "5", "--stream-interval", "2"],
     {"max_top_logprobs_num": 5, "stream_interval": 2}),
    (["--log-level", "DEBUG", "--uvicorn-log-level", "warning"], {"log_level": "debug"}),
    (["--weight-transfer-config", '{"backend": "nccl"}', "--load-format", "dummy"], {}),
    # ignored: logging, kernels, launch details
    (["--disable-log-stats", "--enable-log-requests", "-O3", "--compilation-config",
      '{"mode": 3}', "--async-scheduling", "--api-server-count", "1",
      "--enable-chunked-prefill", "--limit-mm-per-prompt", '{"image": 0}'], {}),
])
def test_mapping(argv: list[str], expected: dict[str, Any]) -> None:
    kwargs = parse(*argv)
    assert kwargs == {"model_path": "/models/m", "host": "127.0.0.1", "port": 8000, **expected}


def test_model_as_flag_and_positional() -> None:
    assert vllm_serve.parse_args(["--model", "/a"], env={})["model_path"] == "/a"
    assert vllm_serve.parse_args(["--port", "1", "--model=/a"], env={})["model_path"] == "/a"
    # vLLM: the positional model wins over --model
    assert vllm_serve.parse_args(["/b", "--model", "/a"], env={})["model_path"] == "/b"


def test_enable_lora_alone_builds_a_config(qwen2_path: str) -> None:
    """vLLM sizes the adapter pool itself (SGLang's rules would want rank and modules)."""
    config = EngineConfig.from_kwargs(**vllm_serve.parse_args(
        [qwen2_path, "--enable-lora", "--max-loras", "2"], env={}))
    assert (config.enable_lora, config.max_lora_rank, config.max_loras_per_batch) == (
        True, 16, 2)


def test_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``--config FILE.yaml``: its keys are flags; the command line wins."""
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9000\nmax_model_len: 128\nenable-prefix-caching: false\n"
                    "served-model-name: [foo]\nspeculative-config:\n  method: ngram\n"
                    "  prompt_lookup_max: 3\nenforce-eager: true\n")
    kwargs = parse("--config", str(path), "--port", "9001")
    assert kwargs == {"model_path": "/models/m", "host": "127.0.0.1", "port": 9001,
                      "context_length": 128,
                      "disable_radix_cache": True, "served_model_name": "foo",
                      "speculative_algorithm": "NGRAM", "disable_cuda_graph": True,
                      "speculative_ngram_min_match_window_size": 3,
                      "speculative_ngram_max_match_window_size": 3}
    assert vllm_serve.parse_args([f"--config={path}", "--model", "/a"], env={})["port"] == 9000
    path.write_text("pipeline-parallel-size: 2\n")
    assert "error: --pipeline-parallel-size 2: " in refused(capsys, "--config", str(path))
    assert "a YAML file" in refused(capsys, "--config", str(tmp_path / "x.json"))
    assert "x.yaml" in refused(capsys, "--config", str(tmp_path / "x.yaml"))   # missing


def test_batch_invariant_env() -> None:
    assert parse(env={"VLLM_BATCH_INVARIANT": "1"})["enable_deterministic_inference"] is True
    assert "enable_deterministic_inference" not in parse(env={"VLLM_BATCH_INVARIANT": "0"})


def test_sizes_are_vllms() -> None:
    assert [human_readable_int(s) for s in ("7", "1k", "1K", "2.5m", "1M", "1g")] == [
        7, 1000, 1024, 2_500_000, 2**20, 10**9]
    assert normalize_argv(["--a_b=1", "-O3", "--x.y.z", "3", "--x.w", "s"]) == [
        "--a-b=1", "--optimization-level", "3", "--x", '{"y": {"z": 3}, "w": "s"}']


def test_result_builds_an_engine_config(qwen2_path: str) -> None:
    kwargs = vllm_serve.parse_args(
        [qwen2_path, "--max-model-len", "256", "--served-model-name", "foo", "--max-num-seqs",
         "4", "--dtype", "float32", "--enable-prefix-caching", "--seed", "3",
         "--logprobs-mode", "processed_logprobs"], env={"VLLM_BATCH_INVARIANT": "1"})
    config = EngineConfig.from_kwargs(**kwargs)
    assert (config.context_length, config.served_model_name, config.max_running_requests,
            config.random_seed, config.port, config.logprobs_mode,
            config.enable_deterministic_inference) == (
        256, "foo", 4, 3, 8000, "processed_logprobs", True)


# -- refused flags -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag, why", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size", "pipeline"),
    (["-pp", "2"], "--pipeline-parallel-size", "pipeline"),
    (["--quantization-config", '{"quant_method": "awq"}'], "--quantization-config",
     "quantization schemes other than"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype", "fp8"),
    (["--enable-expert-parallel"], "--enable-expert-parallel", "expert"),
    (["--worker-extension-cls", "pkg.Mod"], "--worker-extension-cls", "plugin"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb", "offload"),
    (["--served-model-name", "a", "b"], "--served-model-name", "one name only"),
    (["--api-key", "k1", "k2"], "--api-key", "one key only"),
    (["--logprobs-mode", "raw_logits"], "--logprobs-mode", "not logits"),
    (["--speculative-config", '{"method": "eagle", "model": "/d"}'], "--speculative-config",
     "EAGLE"),
    (["--generation-config", "/elsewhere"], "--generation-config", "auto"),
    (["--scheduling-policy", "priority"], "--scheduling-policy", "priorit"),
    (["--runner", "pooling"], "--runner", "generative"),
    (["--load-format", "pt"], "--load-format", "safetensors"),
    (["--max-logprobs", "-1"], "--max-logprobs", "-1"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "--structured-outputs-config",
     "xgrammar"),
    (["--weight-transfer-config", '{"backend": "nccl_m2n"}'], "--weight-transfer-config",
     "backend"),
    (["--chat-template", "/t.jinja"], "--chat-template", "default"),
    (["--ssl-keyfile", "/k"], "--ssl-keyfile", "HTTP"),
])
def test_refused_by_name(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str,
                         why: str) -> None:
    err = refused(capsys, *argv)
    assert f"error: {flag} " in err and why in err


@pytest.mark.parametrize("argv, name", [
    (["--frobnicate"], "--frobnicate"),
    (["--disable-log-requests"], "--disable-log-requests"),   # gone from vLLM 0.32
    (["--model-path", "/x"], "--model-path"),                 # SGLang's, not vLLM's
])
def test_unknown_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str], argv: list[str],
                                        name: str) -> None:
    err = refused(capsys, *argv)
    assert "unrecognized arguments" in err and name in err


def test_missing_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        vllm_serve.parse_args(["--port", "1"], env={})
    assert e.value.code == 2 and "the model is required" in capsys.readouterr().err


DEFAULT_ONLY_SWITCHES = sorted(n for n, f in VLLM_FLAGS.items()
                               if f.treatment == "default" and f.kind in ("switch", "bool")
                               and not f.default)


@pytest.mark.parametrize("name", DEFAULT_ONLY_SWITCHES)
def test_default_only_switch(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Off (vLLM's default) is accepted, on is refused naming the flag."""
    flag = VLLM_FLAGS[name]
    if flag.kind == "bool":
        assert parse("--no-" + flag.option[2:]) == {"model_path": "/models/m", "host": "127.0.0.1", "port": 8000}
    err = refused(capsys, flag.option)
    assert f"error: {flag.option} True: " in err and "vLLM's default" in err


@pytest.mark.parametrize("name", sorted(n for n, f in VLLM_FLAGS.items()
                                        if f.treatment == "ignore" and f.kind in
                                        ("switch", "bool")))
def test_ignored_switch_changes_nothing(name: str) -> None:
    flag = VLLM_FLAGS[name]
    assert parse(flag.option) == {"model_path": "/models/m", "host": "127.0.0.1", "port": 8000}


# -- the console script ------------------------------------------------------------------------
def test_cli_dispatch(monkeypatch: pytest.MonkeyPatch, qwen2_path: str) -> None:
    from rollout_engine.entrypoints import http_server

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(http_server, "run_server", lambda kw: started.append(kw) or 0)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert cli.main(["vllm-serve", qwen2_path, "--port", "8123", "--max-model-len", "64"]) == 0
    # `vllm serve MODEL ...` spelled `rollout-engine serve MODEL ...`
    assert cli.main(["serve", qwen2_path, "-tp", "1", "--served-model-name", "x"]) == 0
    assert started == [
        {"model_path": qwen2_path, "host": "127.0.0.1", "port": 8123, "context_length": 64},
        {"model_path": qwen2_path, "host": "127.0.0.1", "port": 8000, "tp_size": 1, "served_model_name": "x"}]
    # a value EngineConfig refuses: exit 2 before anything starts
    assert cli.main(["vllm-serve", qwen2_path, "--max-num-seqs", "0"]) == 2
    assert len(started) == 2
