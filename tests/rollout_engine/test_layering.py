"""The package's layers, bottom to top, as ``docs/ARCHITECTURE.md`` names them. A module may
import from its own layer or a lower one, never a higher one, and no two packages import each
other (round a circle) even inside one layer. Every import counts, lazy ones included (the graph
of ``test_import_graph``, which also proves no two modules form a circle)."""

from __future__ import annotations

from tests.rollout_engine.test_import_graph import circles, import_graph

# Bottom to top. Each name is a subpackage or a top-level module of rollout_engine; "" is the
# package's own __init__.
LAYERS: list[tuple[str, ...]] = [
    ("env_knobs", "host_lists", "compat", "constrained", "parsers", "penalties",
     "sampling_filters", "sampling_seeds", "detokenizer",
     "quantization", "testing"),                                 # foundations: no engine imports
    ("sampling_params", "protocol"),                             # what crosses a process boundary
    ("parallel", "dp"),                                          # rank and replica math, policy
    ("models",),                                                 # the nn.Modules and their input
    ("memory", "disaggregation"),                                # KV pool, prefix caches, sleep;
                                                                 # moving one prompt's KV
    ("weights",),                                                # loading and refitting
    ("config",),                                                 # EngineConfig
    ("model_runner", "sampler", "processed_logprobs"),           # one forward, one sampling pass
    ("scheduler",),                                              # the step loop's library
    ("speculative",),                                            # a scheduler that drafts
    ("control",),                                                # control calls over a scheduler
    ("runtime", "request_state", "request_builder", "selected_ids", "control_client",
     "tokenizer_manager"),                                       # processes; frontend
    ("entrypoints", "launch_server", ""),                        # Engine, HTTP server, CLI
    ("integrations",),                                           # RL frameworks (verl) on top
]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, imported in graph.items():
        out.setdefault(_part(name), set()).update(
            _part(m) for m in imported if _part(m) != _part(name))
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    layer = _layer_of()
    return [f"{name} -> {m}" for name, imported in sorted(graph.items())
            for m in sorted(imported) if layer[_part(m)] > layer[_part(name)]]


def test_every_package_has_a_layer() -> None:
    graph = import_graph()
    assert len(graph) > 100                                       # the walk saw the package
    assert sorted(set(map(_part, graph)) - set(_layer_of())) == []
    assert sorted(set(_layer_of()) - set(map(_part, graph))) == []   # no stale names


def test_no_module_imports_from_a_higher_layer() -> None:
    assert upward(import_graph()) == []


def test_no_two_packages_import_each_other() -> None:
    assert circles(package_graph(import_graph())) == []


def test_an_upward_import_and_a_package_circle_are_caught() -> None:
    graph = {"rollout_engine.scheduler.scheduler": {"rollout_engine.control.handlers"},
             "rollout_engine.control.handlers": {"rollout_engine.scheduler.scheduler"},
             "rollout_engine.runtime.loop": {"rollout_engine.tokenizer_manager"},
             "rollout_engine.tokenizer_manager": {"rollout_engine.runtime.spawn"}}
    assert upward(graph) == [
        "rollout_engine.scheduler.scheduler -> rollout_engine.control.handlers"]
    assert sorted(map(sorted, circles(package_graph(graph)))) == [
        ["control", "scheduler"], ["runtime", "tokenizer_manager"]]
