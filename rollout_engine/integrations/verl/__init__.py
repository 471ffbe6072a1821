"""verl integration: ``actor_rollout_ref.rollout.name=rollout_engine`` runs this engine's HTTP
server as verl's rollout (verl 0.9.1's replica / server / adapter contract).

Registration: ``import rollout_engine.integrations.verl`` (or verl's own plugin loading, which
imports it in every process that imports verl: the package declares it under the
``verl.plugins`` entry points, and ``VERL_USE_EXTERNAL_MODULES=rollout_engine.integrations.verl``
does the same for a checkout that is not installed) adds the name ``rollout_engine`` to

    RolloutReplicaRegistry   -> replica.RolloutEngineReplica (its server: server.RolloutEngineServer)
    get_rollout_class        -> adapter.ServerAdapter (trainer side: sleep, wake, refit)

Engine flags go in ``actor_rollout_ref.rollout.engine_kwargs.rollout_engine`` (EngineConfig
names or SGLang's, e.g. ``{device: cpu, host: 127.0.0.1}``); verl's rollout settings (dtype,
TP / DP sizes, max_model_len, gpu_memory_utilization, max_num_seqs, enforce_eager) map to the
engine's flags.
"""

from __future__ import annotations

__all__ = ["ADAPTER_PATH", "ROLLOUT_NAME", "register"]

ROLLOUT_NAME = "rollout_engine"
ADAPTER_PATH = "rollout_engine.integrations.verl.adapter.ServerAdapter"


def _load_replica() -> type:
    from rollout_engine.integrations.verl.replica import RolloutEngineReplica

    return RolloutEngineReplica


def register() -> None:
    """Make ``rollout.name=rollout_engine`` resolve to this engine in this process (idempotent).
    verl 0.9.1 has a registration call for replicas only; the trainer-side class is added to
    the table ``get_rollout_class`` reads."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH


register()
