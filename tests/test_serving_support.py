"""Helpers shared by the serving tests (no tests here): configs from the stack files, manifests by kind."""

from __future__ import annotations

import copy
from typing import Any

from infra.config import StackConfig, parse
from infra.scheduling import gpu_placements, system_placement
from infra.serving.endpoint import serve_service_spec
from infra.serving.ray_service import VllmRayServiceArgs
from tests.harness import manifests_of, render_stack, stack_doc

PREFIX = "llm-platform:"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving@sha256:" + "a" * 64


def config(stack: str, **overrides: Any) -> StackConfig:
    """A committed stack's config, with top-level sections replaced."""
    doc = copy.deepcopy(stack_doc(stack)["config"])
    raw = {k.removeprefix(PREFIX): v for k, v in doc.items() if k.startswith(PREFIX)}
    raw["region"] = doc["aws:region"]
    raw.update(overrides)
    return parse(raw)


def ray_service_args(cfg: StackConfig, service: str, **overrides: Any) -> VllmRayServiceArgs:
    """Hand-made arguments for one RayService of `cfg`, as build_serving would give them."""
    values: dict[str, Any] = {
        "cfg": cfg,
        "name": service,
        "models": cfg.services()[service],
        "namespace": cfg.serving.namespace,
        "image": IMAGE,
        "system": system_placement(cfg),
        "gpu": gpu_placements(cfg),
        "model_reader_service_account": "model-reader",
        "api_keys_secret": "inference-api-keys",
        "storage_class": "gp3-encrypted",
        "prometheus_url": "http://prometheus.monitoring.svc:9090",
        "grafana_url": "http://grafana.monitoring.svc:80",
        "serving_priority_class": "llm-serving",
        "serve_service": serve_service_spec(service, cfg.serving.namespace, cfg.endpoint),
    }
    values.update(overrides)
    return VllmRayServiceArgs(**values)


def ray_services(stack: str) -> list[dict[str, Any]]:
    """The RayServices of a rendered stack."""
    return manifests_of(render_stack(stack), "RayService")


def group(ray_service: dict[str, Any], name: str) -> dict[str, Any]:
    """One worker group of a RayService."""
    groups = ray_service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    found = [g for g in groups if g["groupName"] == name]
    assert len(found) == 1, f"{name} not in {[g['groupName'] for g in groups]}"
    only: dict[str, Any] = found[0]
    return only
