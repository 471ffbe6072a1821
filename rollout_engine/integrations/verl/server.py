"""`RolloutEngineServer`: verl's rollout server actor for this engine, the counterpart of
verl's ``SGLangHttpServer`` (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``).

verl calls these methods on the actor (one per replica; the replica's ``server_handle``):

    launch_server()                  start ``launch_server`` (a child process) and wait for it
    get_server_address()             (host, port) of its HTTP server
    generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput   POST /generate
    abort_all_requests(reject_request)   POST /pause_generation {"mode": "abort"}
    resume_generation()              POST /continue_generation
    sleep() / wake_up()              /release_memory_occupation, /resume_memory_occupation
    release_kv_cache() / resume_kv_cache()   the same, kv_cache only
    clear_kv_cache()                 /flush_cache
    set_global_steps(n)              /update_weight_version (n becomes the weight version)

Generation follows verl's SGLang server: token ids in, token ids and (when
``sampling_params["logprobs"]``) their logprobs out, ``max_new_tokens`` from the request or
verl's ``response_length`` within ``max_model_len``. ``TokenOutput.stop_reason`` is verl's
vocabulary: "completed" (stop or length) or "aborted". ``extra_fields["global_steps"]`` is the
weight version the engine generated the request with, when it is a step number.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_visible_devices_keyword
from verl.utils.net_utils import is_valid_ipv6_address
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput
from verl.workers.rollout.sglang_rollout.utils import lora_served_as_adapter
from verl.workers.rollout.utils import get_max_position_embeddings

from rollout_engine.integrations.verl.engine_http import EngineCallError, EngineHttp
from rollout_engine.integrations.verl.launch import ServerProcess, engine_flags, free_port
from rollout_engine.integrations.verl.token_io import generate_body, token_output

__all__ = ["ENGINE_KWARGS_KEY", "RolloutEngineServer", "engine_options"]

logger = logging.getLogger(__name__)

ENGINE_KWARGS_KEY = "rollout_engine"
"""``actor_rollout_ref.rollout.engine_kwargs.rollout_engine``: extra engine flags (EngineConfig
names or SGLang's), and ``host``, the address the server binds and is reached at."""


def engine_options(config: RolloutConfig) -> dict[str, Any]:
    """The user's flags for this engine from verl's rollout config (a copy)."""
    engine_kwargs = config.get("engine_kwargs", {}) or {}
    options = engine_kwargs.get(ENGINE_KWARGS_KEY, {}) or {}
    return dict(options)


class RolloutEngineServer:
    """One replica's server actor (verl creates it with ``ray.remote``). Arguments are those
    verl's replica passes to its SGLang server actor; a replica is one node."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig,
                 rollout_mode: RolloutMode, workers: list[Any], replica_rank: int,
                 node_rank: int, nnodes: int, cuda_visible_devices: str,
                 base_gpu_id: int) -> None:
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(
            model_config, dataclass_type=HFModelConfig)
        if nnodes != 1 or node_rank != 0:
            raise ValueError(f"rollout_engine serves a replica from one node; got nnodes={nnodes}"
                             f", node_rank={node_rank}")
        if lora_served_as_adapter(self.model_config):
            raise ValueError("rollout_engine's verl integration serves no LoRA adapters yet "
                             "(verl's adapter path is not wired): set "
                             "actor_rollout_ref.model.lora.merge=True so the trainer sends merged "
                             "weights")
        max_len = get_max_position_embeddings(self.model_config.hf_config)
        if self.config.max_model_len is None:
            self.config.max_model_len = max_len
        elif self.config.max_model_len > max_len:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) must be at most the "
                             f"model's max_position_embeddings ({max_len})")
        self.rollout_mode = rollout_mode
        self.workers = workers
        self.replica_rank = replica_rank
        self.cuda_visible_devices = cuda_visible_devices
        self.base_gpu_id = base_gpu_id
        self.options = engine_options(self.config)
        self.host: str = self.options.pop("host", None) or _node_address()
        self.port: Optional[int] = None
        self.process: Optional[ServerProcess] = None
        self._http: Optional[EngineHttp] = None
        self._rejecting = False   # abort_all_requests(reject_request=True) until resumed

    # ---- lifecycle ---------------------------------------------------------------------------

    def flags(self, port: int) -> list[str]:
        """launch_server's command line for this replica: verl's rollout settings, then the
        user's ``engine_kwargs.rollout_engine`` (which win)."""
        config = self.config
        keep_weights = self.rollout_mode in (RolloutMode.COLOCATED, RolloutMode.HYBRID)
        options: dict[str, Any] = {
            "model_path": self.model_config.local_path,
            "dtype": config.dtype,
            "context_length": config.max_model_len,
            "mem_fraction_static": config.gpu_memory_utilization,
            "tp_size": config.tensor_model_parallel_size,
            "dp_size": config.data_parallel_size,
            "max_running_requests": config.get("max_num_seqs", None),
            # a colocated engine sleeps while the trainer runs and must keep its weights
            "enable_weights_cpu_backup": keep_weights,
            "enable_memory_saver": True,
            "disable_cuda_graph": True if config.enforce_eager else None,
            "base_gpu_id": self.base_gpu_id or None,
            "host": self.host,
            "port": port,
        }
        options.update(self.options)
        return engine_flags(options)

    async def launch_server(self, master_address: Optional[str] = None,
                            master_port: Optional[int] = None) -> None:
        """Start the server and return once it answers /health (RuntimeError with its output
        if it exits first). ``master_*`` are verl's multi-node arguments, unused here."""
        if self.process is not None:
            raise RuntimeError("launch_server was called twice on one rollout_engine server")
        port = self.options.pop("port", None) or free_port(self.host)
        env = dict(os.environ)
        if self.cuda_visible_devices:
            env[get_visible_devices_keyword()] = self.cuda_visible_devices
        self.process = ServerProcess(self.flags(port), env)
        self.process.start()
        self.port = port
        api_key = self.options.get("admin_api_key") or self.options.get("api_key")
        self._http = EngineHttp(self.url, api_key=api_key)
        await asyncio.to_thread(self.process.wait_healthy, self.url,
                                headers=self._http.headers)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if is_valid_ipv6_address(self.host) else self.host
        return f"http://{host}:{self.port}"

    def get_master_address(self) -> tuple[None, None]:
        """No multi-node rendezvous: a replica is one node."""
        return None, None

    def get_server_address(self) -> tuple[str, int]:
        if self.port is None:
            raise RuntimeError("the rollout_engine server is not launched yet")
        return self.host, self.port

    async def shutdown(self) -> Optional[int]:
        """Stop the server process (it also ends when this actor's process does)."""
        if self._http is not None:
            await self._http.aclose()
        return None if self.process is None else self.process.stop()

    def _engine(self) -> EngineHttp:
        if self._http is None:
            raise RuntimeError("the rollout_engine server is not launched yet")
        return self._http

    # ---- generation --------------------------------------------------------------------------

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None,
                       video_data: Optional[list[Any]] = None, **kwargs: Any) -> TokenOutput:
        """One request, token ids in and out (see the module docstring). Multimodal inputs are
        a ValueError: the engine serves text-only models."""
        if self._rejecting:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                               extra_fields={"global_steps": None})
        request = generate_body(prompt_ids, sampling_params, request_id, self.config,
                                image_data=image_data, video_data=video_data, **kwargs)
        answer = await self._engine().call("/generate", request.body, timeout_s=None)
        return token_output(answer, request)

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Abort every running request (they answer "aborted" with what they generated) and
        hold new ones until `resume_generation`; with ``reject_request`` new ones are answered
        "aborted" at once instead of held."""
        self._rejecting = reject_request
        return await self._engine().call("/pause_generation", {"mode": "abort"})

    async def resume_generation(self) -> dict[str, Any]:
        self._rejecting = False
        return await self._engine().call("/continue_generation", {})

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer's step becomes the engine's weight version (what requests report)."""
        await self._engine().call("/update_weight_version",
                                  {"new_version": str(global_steps), "abort_all_requests": False})

    # ---- memory ------------------------------------------------------------------------------

    def _sleep_tags(self) -> list[str]:
        if self.rollout_mode == RolloutMode.STANDALONE:
            return ["kv_cache"]
        return ["kv_cache", "weights"]

    async def sleep(self) -> None:
        """Release the KV cache and (hybrid, colocated) the weights, if ``free_cache_engine``."""
        if self.config.free_cache_engine:
            await self._engine().call("/release_memory_occupation", {"tags": self._sleep_tags()})

    async def wake_up(self) -> None:
        """Give back what `sleep` released and flush the prefix cache. In hybrid mode the
        trainer wakes the engine through its refit (as verl's SGLang server requires)."""
        if self.rollout_mode == RolloutMode.HYBRID:
            raise ValueError("wake_up is not used in hybrid mode: the trainer's update_weights "
                             "resumes the engine")
        if self.config.free_cache_engine:
            await self._engine().call("/resume_memory_occupation", {"tags": self._sleep_tags()})
        await self.clear_kv_cache()

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self._engine().call("/release_memory_occupation", {"tags": ["kv_cache"]})

    async def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self._engine().call("/resume_memory_occupation", {"tags": ["kv_cache"]})
            await self.clear_kv_cache()

    async def clear_kv_cache(self) -> bool:
        """Flush the prefix cache; False (logged) when requests are running, which keep it."""
        try:
            await self._engine().call("/flush_cache", {})
        except EngineCallError as e:
            if e.status != 409:
                raise
            logger.warning("rollout_engine kept its prefix cache: %s", e.message)
            return False
        return True

    async def start_profile(self, **kwargs: Any) -> None:
        """The engine has no profiler routes: nothing to start."""

    async def stop_profile(self) -> None:
        """The engine has no profiler routes: nothing to stop."""


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]")
