"""SGLang's launch flags and ``ServerArgs`` keywords, as the RL frameworks build them, start our
server; a flag we cannot honour exits 2 naming it. The table is checked against EngineConfig.

Command lines and keyword sets are copied from the frameworks' source:
    AReaL  areal/api/cli_args.py        SGLangConfig defaults, build_args, get_py_cmd
    slime  slime/backends/sglang_utils/sglang_engine.py   _compute_server_args
    verl   verl/workers/rollout/sglang_rollout/async_sglang_server.py   launch_server
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from rollout_engine.compat.server_args import (
    ALIASES,
    IGNORED,
    SGLANG_FLAGS,
    UNSUPPORTED,
    UnsupportedFlagError,
    parse_size,
)
from rollout_engine.config import EngineConfig
from rollout_engine.entrypoints.launch_server import build_parser, parse_args
from tests.rollout_engine.entrypoints.conftest import bound_socket

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


# -- the frameworks' flag sets ---------------------------------------------------------------
def areal_args(model_path: str, host: str, port: int, **config: Any) -> dict[str, Any]:
    """AReaL's SGLangConfig defaults through SGLangConfig.build_args(tp_size=1, base_gpu_id=0)."""
    sglang_config = dict(
        model_path=model_path, random_seed=1, skip_tokenizer_init=False,
        disable_cuda_graph=False, disable_radix_cache=True, disable_cuda_graph_padding=False,
        enable_nccl_nvls=False, disable_outlines_disk_cache=False,
        disable_custom_all_reduce=False, disable_overlap_schedule=False, enable_mixed_chunk=False,
        enable_dp_attention=False, enable_ep_moe=False, enable_torch_compile=False,
        torch_compile_max_bs=32, cuda_graph_max_bs=None, cuda_graph_bs=None, torchao_config="",
        enable_nan_detection=False, enable_p2p_check=False,
        triton_attention_reduce_in_fp32=False, triton_attention_num_kv_splits=8,
        num_continuous_decode_steps=1, enable_memory_saver=False, allow_auto_truncate=False,
        attention_backend="fa3", enable_multimodal=False, sampling_backend=None,
        context_length=32768, mem_fraction_static=0.9, max_running_requests=None,
        chunked_prefill_size=-1, max_prefill_tokens=32768, schedule_policy="lpm",
        schedule_conservativeness=1.0, cpu_offload_gb=0, dtype="bfloat16", kv_cache_dtype="auto",
        dp_size=1, ep_size=1, enable_lora=None, max_lora_rank=None, max_loaded_loras=8,
        lora_paths=None, lora_backend="triton", log_level="warning", log_level_http="warning",
        log_requests=False, log_requests_level=0, show_time_cost=False, enable_metrics=True,
        decode_log_interval=1, enable_return_routed_experts=False)
    sglang_config.update(config)
    args = dict(tokenizer_path=model_path, tokenizer_mode="auto", load_format="auto",
                trust_remote_code=True, is_embedding=False, tp_size=1, base_gpu_id=0, nnodes=1,
                node_rank=0, dist_init_addr=None, **sglang_config)
    args["host"], args["port"] = host, port
    return args


def py_cmd_flags(args: dict[str, Any]) -> list[str]:
    """AReaL's get_py_cmd, without the interpreter and module."""
    cmd: list[str] = []
    for k, v in args.items():
        if v is None or v is False or v == "" or (isinstance(v, list) and not v):
            continue
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            cmd.append(flag)
        elif isinstance(v, list):
            cmd.extend([flag, *map(str, v)])
        else:
            cmd.extend([flag, str(v)])
    return cmd


def slime_kwargs(model_path: str) -> dict[str, Any]:
    """slime's _compute_server_args for one colocated engine on one GPU (offload_rollout)."""
    return {
        "model_path": model_path, "trust_remote_code": True, "random_seed": 1234,
        "enable_memory_saver": True, "host": "127.0.0.1", "port": 15000, "nccl_port": 15001,
        "nnodes": 1, "node_rank": 0, "dist_init_addr": "127.0.0.1:15002", "gpu_id_step": 1,
        "base_gpu_id": 0, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
        "skip_server_warmup": True, "enable_draft_weights_cpu_backup": True,
        "enable_metrics": True, "cuda_graph_backend_prefill": "disabled",
    }


def verl_kwargs(model_path: str) -> dict[str, Any]:
    """verl's AsyncSGLangServer.launch_server args for one colocated replica (rollout.yaml
    defaults: load_format dummy, skip_tokenizer_init true, fa3 attention)."""
    return {
        "model_path": model_path, "dtype": "bfloat16", "mem_fraction_static": 0.5,
        "disable_cuda_graph": True, "enable_memory_saver": True, "base_gpu_id": 0,
        "gpu_id_step": 1, "tp_size": 1, "dp_size": 1, "ep_size": 1, "node_rank": 0,
        "load_format": "dummy", "dist_init_addr": "127.0.0.1:20000", "nnodes": 1,
        "trust_remote_code": False, "max_running_requests": None, "log_level": "error",
        "mm_attention_backend": "fa3", "attention_backend": "fa3",
        "skip_tokenizer_init": True, "skip_server_warmup": True, "quantization": None,
        "json_model_override_args": json.dumps({}), "enable_weights_cpu_backup": True,
    }


# -- the table --------------------------------------------------------------------------------
def test_table_rows_are_consistent_with_engine_config() -> None:
    assert len(SGLANG_FLAGS) > 500     # every flag of two SGLang releases
    for name, flag in SGLANG_FLAGS.items():
        assert flag.treatment in {"ours", "special", "ignore", "default"}, name
        if flag.treatment == "ours":
            assert name in FIELDS, f"{name}: 'ours' but not an EngineConfig field"
        if flag.treatment == "ignore":
            assert flag.why in IGNORED, name
        if flag.treatment == "default":
            assert flag.why in UNSUPPORTED, name
        json.dumps(flag.default)
    # a field of ours that SGLang also has is SGLang's flag, not a second meaning of the name
    assert {n for n in FIELDS if n in SGLANG_FLAGS} == {
        n for n, f in SGLANG_FLAGS.items() if f.treatment == "ours"}
    strings = [s for f in SGLANG_FLAGS.values() for s in f.option_strings]
    assert len(strings) == len(set(strings))
    assert set(ALIASES) <= set(SGLANG_FLAGS)
    assert SGLANG_FLAGS["tp_size"].option_strings == ("--tp-size", "--tensor-parallel-size")


def test_every_sglang_flag_parses_at_its_default(qwen2_path: str) -> None:
    """Any SGLang command line that spells out defaults is accepted: each row's flag, given its
    own default (a switch: absent), translates to nothing or to a valid value of our field."""
    argv = ["--model-path", "/m"]
    for name, flag in SGLANG_FLAGS.items():
        if name == "model_path" or flag.default is None or flag.default == [] \
                or flag.kind == "switch" and flag.default is False:
            continue
        if flag.kind in ("switch", "bool"):
            argv.append(flag.option if flag.default else "--no-" + flag.option[2:])
            continue
        values = flag.default if isinstance(flag.default, list) else [flag.default]
        argv += [flag.option, *(json.dumps(v) if flag.kind.startswith("json") else str(v)
                                for v in values)]
    assert len(argv) > 300          # ~170 flags with a value as default
    kwargs = parse_args(argv)
    assert set(kwargs) <= set(FIELDS) and kwargs["model_path"] == "/m"
    cfg = EngineConfig.from_kwargs(**{**kwargs, "model_path": qwen2_path})
    assert (cfg.schedule_policy, cfg.log_level) == ("fcfs", "info")    # SGLang's, spelled out


# -- command lines ------------------------------------------------------------------------------
def test_areal_command_line() -> None:
    argv = py_cmd_flags(areal_args("/models/qwen", "10.0.0.1", 30001))
    assert "--tp-size" in argv and "--attention-backend" in argv and "--trust-remote-code" in argv
    assert parse_args(argv) == {
        "model_path": "/models/qwen", "tokenizer_path": "/models/qwen", "random_seed": 1,
        "disable_radix_cache": True, "context_length": 32768, "mem_fraction_static": 0.9,
        # SGLang's -1 (no chunking): one chunk per prefill budget
        "chunked_prefill_size": 32768, "max_prefill_tokens": 32768, "dtype": "bfloat16",
        "host": "10.0.0.1", "port": 30001, "max_loaded_loras": 8,   # inert without LoRA
        # logging and launch knobs: no effect here, kept to be reported by get_server_info
        "ignored_sglang_args": {
            "trust_remote_code": True, "lora_backend": "triton",
            "log_level_http": "warning", "log_requests_level": 0, "enable_metrics": True,
            "decode_log_interval": 1},
    }   # fa3: not ours, the device's default backend; lpm / warning: our defaults already


def test_sglang_spellings_are_converted() -> None:
    base = ["--model", "/m"]
    assert parse_args([*base, "--dtype", "half"])["dtype"] == "float16"
    assert parse_args([*base, "--dtype", "float"])["dtype"] == "float32"
    assert parse_args([*base, "--context-length", "32k", "--max-total-tokens", "1Mi"]) == {
        "model_path": "/m", "context_length": 32000, "max_total_tokens": 2**20}
    assert parse_args([*base, "--base-gpu-id", "3"])["device"] == "cuda:3"
    assert parse_args([*base, "--chunked-prefill-size", "-1", "--max-prefill-tokens", "4096"]
                      )["chunked_prefill_size"] == 4096
    assert parse_args([*base, "--stream-output"])["incremental_streaming_output"] is True
    assert parse_args([*base, "--enable-deterministic-inference"]) == {
        "model_path": "/m", "enable_deterministic_inference": True}
    assert parse_args([*base, "--rl-on-policy-target", "fsdp"]) == {
        "model_path": "/m", "enable_deterministic_inference": True}
    assert parse_args([*base, "--tensor-parallel-size", "1", "--dp-size", "1", "--pp-size",
                       "1", "--enable-memory-saver", "--attention-backend", "triton",
                       "--load-format", "dummy", "--skip-tokenizer-init"]) == {
        "model_path": "/m", "enable_memory_saver": True, "attention_backend": "triton",
        "ignored_sglang_args": {"load_format": "dummy", "skip_tokenizer_init": True}}
    assert parse_args([*base, "--data-parallel-size", "2", "--load-balance-method",
                       "total_requests"]) == {
        "model_path": "/m", "dp_size": 2, "load_balance_method": "total_requests"}
    assert parse_size("25.6k") == 25600 and parse_size("2Ki") == 2048 and parse_size("7") == 7


@pytest.mark.parametrize("argv,named", [
    (["--pp-size", "2"], "--pp-size 2: rollout_engine shards a model only by tensor "
                         "parallelism"),
    (["--expert-parallel-size", "4"], "--ep-size 4"),
    (["--nnodes", "2"], "--nnodes 2"),
    (["--torchao-config", "int8wo"], "--torchao-config 'int8wo': quantized KV caches and "
     "quantization schemes other than --quantization w8a8_int8 / fp8"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm 'EAGLE': speculative "
     "decoding: --speculative-algorithm NGRAM and STANDALONE (a draft model) are implemented"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm 'EAGLE3': speculative "
     "decoding: --speculative-algorithm NGRAM and STANDALONE"),
    (["--speculative-algorithm", "MTP"], "--speculative-algorithm 'MTP': speculative "
     "decoding: --speculative-algorithm NGRAM and STANDALONE"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype 'fp8_e4m3': the KV cache is kept in "
     "the served dtype: auto is accepted, and bf16 / bfloat16 when the model runs in bfloat16; "
     "quantized KV caches (fp8_e5m2, fp8_e4m3, fp4_e2m1) are not implemented"),
    (["--load-format", "gguf"], "--load-format 'gguf'"),
    (["--base-gpu-id", "1", "--device", "cpu"], "--base-gpu-id 1"),
    (["--is-embedding"], "--is-embedding True: only generative models"),
])
def test_flags_we_cannot_honour_exit_2_naming_them(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "/m", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {named}" in err
    assert "usage:" in err


# -- flags slime and miles pass at values that cost nothing --------------------------------------
# miles scripts/run_glm5_744b_a40b.py (and run_deepseek_v32.py, run_qwen3_30b_a3b.py): the
# --sglang-* arguments, prefix dropped, that this engine takes (its dp-attention / ep / nsa
# flags are refused or ignored on their own)
MILES_BF16_KV = ["--mem-fraction-static", "0.70", "--kv-cache-dtype", "bf16", "--page-size",
                 "64", "--cuda-graph-max-bs", "256", "--max-running-requests", "512",
                 "--chunked-prefill-size", "16384", "--watchdog-timeout", "3600"]


def test_kv_cache_dtype_that_names_the_served_dtype_is_accepted(qwen2_path: str) -> None:
    kwargs = parse_args(["--model-path", qwen2_path, *MILES_BF16_KV])
    assert kwargs["kv_cache_dtype"] == "bf16" and kwargs["page_size"] == 64
    on_gpu = EngineConfig.from_kwargs(**kwargs, device="cuda")     # auto: bfloat16 there
    assert (on_gpu.kv_cache_dtype, str(on_gpu.resolved_dtype())) == ("bf16", "torch.bfloat16")
    for name in ("bf16", "bfloat16", "auto"):
        EngineConfig.from_kwargs(**{**kwargs, "kv_cache_dtype": name}, dtype="bfloat16",
                                 device="cpu")
    # the same flag on an engine that serves float32 would be a promise it does not keep
    with pytest.raises(ValueError, match=r"^EngineConfig.kv_cache_dtype: 'bf16' is not "
                       r"supported: the KV cache is kept in the served dtype \(float32 here;.*"
                       r"accepted here: 'auto'$"):
        EngineConfig.from_kwargs(**kwargs, device="cpu")


@pytest.mark.parametrize("argv", [
    ["--tool-call-parser", "qwen25"],                           # miles examples/.../run_hud2048
    ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"],   # miles verify_session_tito
    ["--reasoning-parser", "deepseek-r1", "--tool-call-parser", "llama3"],
    ["--tool-call-parser", "hermes", "--sampling-defaults", "openai"],
])
def test_implemented_output_parsers_are_accepted(qwen2_path: str, argv: list[str]) -> None:
    kwargs = parse_args(["--model-path", qwen2_path, *argv])
    cfg = EngineConfig.from_kwargs(**kwargs)
    for flag, value in zip(argv[::2], argv[1::2]):
        assert getattr(cfg, flag[2:].replace("-", "_")) == value


@pytest.mark.parametrize("argv, named", [
    (["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"],   # slime coding agent
     "EngineConfig.tool_call_parser: 'qwen3_coder' is one of SGLang's parsers that this engine "
     "does not implement; the tool-call parsers implemented: hermes, llama3, qwen, qwen25"),
    (["--reasoning-parser", "glm45", "--tool-call-parser", "qwen25"],       # miles glm scripts
     "EngineConfig.reasoning_parser: 'glm45' is one of SGLang's parsers that this engine does "
     "not implement; the reasoning parsers implemented: deepseek-r1, interns1, minimax, qwen3, "
     "qwen3-thinking, step3, step3p5"),
    (["--sampling-defaults", "vllm"],
     "EngineConfig.sampling_defaults: must be one of ['model', 'openai'], got 'vllm'"),
], ids=["qwen3_coder", "glm45", "sampling-defaults"])
def test_output_parsers_we_lack_exit_2_listing_ours(
        qwen2_path: str, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout_engine.entrypoints.launch_server import main

    assert main(["--model-path", qwen2_path, *argv]) == 2
    assert f"error: {named}" in capsys.readouterr().err


def test_a_flag_sglang_lacks_too_is_unrecognized(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "/m", "--frobnicate", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_help_lists_our_flags_and_hides_sglangs() -> None:
    text = build_parser().format_help()
    assert "--mem-fraction-static" in text and "--scheduler-mode" in text
    assert "--enable-nccl-nvls" not in text and "--pp-size PP_SIZE" not in text
    assert "--tp-size TP_SIZE" in text   # ours (tensor parallelism)
    assert "python -m sglang.launch_server" in text


# -- Engine(**server_args) ------------------------------------------------------------------
def test_slime_and_verl_server_args_build_an_engine_config(qwen2_path: str) -> None:
    slime = EngineConfig.from_kwargs(**slime_kwargs(qwen2_path))
    assert slime.enable_memory_saver is True and slime.random_seed == 1234
    assert slime.host == "127.0.0.1" and slime.port == 15000 and slime.device == "auto"
    verl = EngineConfig.from_kwargs(**verl_kwargs(qwen2_path))
    assert (verl.dtype, verl.mem_fraction_static, verl.log_level) == ("bfloat16", 0.5, "error")
    assert verl.disable_cuda_graph and verl.enable_memory_saver and verl.enable_weights_cpu_backup
    assert verl.attention_backend is None and verl.max_running_requests is None
    # SGLang's "choose for me" None and a switch's False mean its default
    cfg = EngineConfig.from_kwargs(model_path=qwen2_path, enable_lora=False, page_size=None,
                                   mem_fraction_static=None, cuda_graph_max_bs=None)
    assert (cfg.page_size, cfg.mem_fraction_static, cfg.cuda_graph_max_bs) == (1, 0.8, 64)


@pytest.mark.parametrize("kwargs,named", [
    ({"ep_size": 2}, "--ep-size 2"), ({"pp_size": 2}, "--pp-size 2"),
    ({"skip_tokenizer_init": True, "lora_strict_loading": True}, "--lora-strict-loading True"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "--kv-cache-dtype 'fp8_e5m2'"),
])
def test_engine_kwargs_we_cannot_honour_name_the_flag(
        qwen2_path: str, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedFlagError) as e:
        EngineConfig.from_kwargs(model_path=qwen2_path, **kwargs)
    assert str(e.value).startswith(named)


def test_unknown_engine_kwarg_is_refused(qwen2_path: str) -> None:
    with pytest.raises(ValueError, match="unknown engine flag.*frobnicate"):
        EngineConfig.from_kwargs(model_path=qwen2_path, frobnicate=1)


# -- a real launch ----------------------------------------------------------------------------
def test_launch_server_with_areals_sglang_command_line(qwen2_path: str) -> None:
    """``python -m rollout_engine.launch_server`` with the flags AReaL gives
    ``python -m sglang.launch_server`` (its config set to a tiny CPU model): it serves
    /health and /get_server_info, and exits 0 on SIGTERM."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    args = areal_args(qwen2_path, "127.0.0.1", port, context_length=256,
                      enable_memory_saver=True, dtype="float32")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_engine.launch_server", *py_cmd_flags(args)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    serving = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("rollout_engine: serving"):
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(180), "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for path in ("/get_server_info", "/server_info"):
            info = httpx.get(url + path, timeout=30).json()
            assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
            assert info["enable_memory_saver"] is True and info["disable_radix_cache"] is True
            assert (info["random_seed"], info["context_length"], info["dtype"]) == (
                1, 256, "float32")
            assert info["chunked_prefill_size"] == 32768 and info["max_prefill_tokens"] == 32768
            assert info["model_path"] == info["tokenizer_path"] == qwen2_path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
