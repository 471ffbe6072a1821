"""Adapters that plug the engine into RL frameworks, one subpackage per framework.

Each subpackage imports its framework, so nothing in the rest of the package imports them; a
user imports the one they need (``import rollout_engine.integrations.verl``)."""
