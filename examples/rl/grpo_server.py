"""GRPO against a rollout *server*: the same loop as grpo_colocated.py, but the engine is a
separate process (`python -m rollout_engine.launch_server`, started here on a free port) driven
over HTTP with `trainer_bridge.RolloutClient`, and refitted by a torch.distributed broadcast
(gloo on CPU) through `WeightSyncer(transport="distributed")`.

    python examples/rl/grpo_server.py
    python examples/rl/grpo_server.py --tiny          # CI smoke run
    python examples/rl/grpo_server.py --moe --routing-replay   # a tiny Qwen3-MoE with R3
    python examples/rl/grpo_server.py --url http://127.0.0.1:30000   # a server you started
    python examples/rl/grpo_server.py --lora    # an adapter: the base by broadcast once, then
                                                # the adapter's tensor handles each step

Routes used: /health, /generate, /get_weight_version, /release_memory_occupation,
/resume_memory_occupation, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /check_integrity; with --lora also /update_weight_version and
/load_lora_adapter_from_tensors (docs/API.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_loop import Trainer, add_common_args, resolve_args, run  # noqa: E402
from grpo_lora import LoraPolicySync, server_flags  # noqa: E402

RL_ROUTES = ("/generate", "/get_weight_version", "/release_memory_occupation",
             "/resume_memory_occupation", "/init_weights_update_group",
             "/update_weights_from_distributed", "/destroy_weights_update_group")
LORA_ROUTES = ("/update_weight_version", "/load_lora_adapter_from_tensors")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, out_dir="runs/grpo_server")
    p.add_argument("--url", help="use this running server (same --model-dir) instead of "
                                 "starting one")
    p.add_argument("--bucket-mb", type=int, default=64,
                   help="flattened-bucket size of the broadcast refit")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="server KV capacity")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    resolve_args(args)
    return args


def missing_routes(client: Any, routes: tuple[str, ...] = RL_ROUTES) -> list[str]:
    """The ``routes`` this server does not serve (read from its OpenAPI schema; [] when the
    schema is unavailable: the calls themselves will then say what is wrong)."""
    try:
        response = client.http.get("/openapi.json")
        paths = response.json()["paths"] if response.status_code == 200 else None
    except Exception:  # noqa: BLE001 - best effort
        paths = None
    return [] if paths is None else [r for r in routes if r not in paths]


def start_server(args: argparse.Namespace, model_dir: Path, log_path: Path
                 ) -> tuple[subprocess.Popen, str]:
    from trainer_bridge.transports.group_ranks import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rollout_engine.launch_server", "--model-path", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--device", "cpu",
           "--max-total-tokens", str(args.max_total_tokens), "--num-threads", str(args.threads),
           "--random-seed", str(args.seed), "--weight-version", "init"]
    if args.routing_replay:
        cmd.append("--enable-return-routed-experts")
    cmd += server_flags(args)
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: Optional[subprocess.Popen]) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from trainer_bridge import RolloutClient, WeightSyncer

    args = parse_args(argv)
    t_start = time.perf_counter()
    proc: Optional[subprocess.Popen] = None
    log_path = Path(args.out_dir) / "server.log"
    try:
        if args.url:
            url = args.url
            trainer = Trainer(args)
        else:
            # the model directory must exist before the server starts; the warm-start (trainer
            # side) overlaps with the server's start-up
            from grpo_common import ensure_model
            ensure_model(Path(args.model_dir), args.seed, args.moe)
            proc, url = start_server(args, Path(args.model_dir), log_path)
            trainer = Trainer(args)
        client = RolloutClient(url)
        try:
            try:
                client.wait_healthy(args.server_start_timeout)
            except TimeoutError as e:
                raise RuntimeError(f"{e}; server log: {log_path}") from e
            missing = missing_routes(client, RL_ROUTES + (LORA_ROUTES if args.lora else ()))
            if missing:
                raise NotImplementedError(f"the server at {url} lacks the RL route(s) "
                                          f"{', '.join(missing)} (docs/API.md)")
            with WeightSyncer(client, transport="distributed", backend="gloo",
                              bucket_bytes=args.bucket_mb << 20) as syncer:
                if args.lora:
                    with LoraPolicySync(client, trainer, syncer) as lora_syncer:
                        summary = run(args, client, lora_syncer, trainer, "grpo_server",
                                      t_start)
                else:
                    summary = run(args, client, syncer, trainer, "grpo_server", t_start)
            integrity = client.http.get("/check_integrity")
            if integrity.status_code != 200:
                raise RuntimeError(f"/check_integrity: {integrity.status_code} {integrity.text}")
        finally:
            client.close()
    finally:
        stop_server(proc)
    return summary


if __name__ == "__main__":
    main()
