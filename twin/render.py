"""The RayServices of an offline render (``python -m infra.render``), read from its ``manifests.yaml``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MODELS_KEY = "llm-platform:models"


class TwinInputError(Exception):
    """Bad input to the twin (missing render, unreadable manifests): one line, exit 2."""


def _where(err: yaml.YAMLError) -> str:
    """A YAML error in one line: where, and what."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(err, "problem", None) or "not YAML").replace("\n", " ")


@dataclass(frozen=True)
class RayServiceSpec:
    """One rendered RayService."""

    name: str
    namespace: str
    metadata: dict[str, Any]
    spec: dict[str, Any]

    @property
    def cluster(self) -> dict[str, Any]:
        """``spec.rayClusterConfig``."""
        return dict(self.spec.get("rayClusterConfig") or {})

    @property
    def ray_cr(self) -> dict[str, Any]:
        """The RayCluster custom resource KubeRay makes of it, as Ray's autoscaler reads it."""
        return {"metadata": self.metadata, "spec": self.cluster}

    @property
    def excludes_head(self) -> bool:
        """Whether the serve Service leaves the head pod out."""
        return bool(self.spec.get("excludeHeadPodFromServeSvc", False))

    def serve_config(self) -> dict[str, Any]:
        """``spec.serveConfigV2``, parsed (the CRD field is a YAML string)."""
        raw = self.spec.get("serveConfigV2")
        if not isinstance(raw, str):
            raise TwinInputError(f"RayService {self.name}: spec.serveConfigV2 is not a YAML string")
        try:
            parsed = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise TwinInputError(
                f"RayService {self.name}: spec.serveConfigV2 is not valid YAML ({_where(err)})"
            ) from None
        if not isinstance(parsed, dict):
            raise TwinInputError(f"RayService {self.name}: spec.serveConfigV2 is not a mapping")
        return parsed

    def worker_groups(self) -> list[dict[str, Any]]:
        """``workerGroupSpecs``."""
        return list(self.cluster.get("workerGroupSpecs") or [])


def load_ray_services(render_dir: Path) -> list[RayServiceSpec]:
    """Every RayService in ``render_dir/manifests.yaml``; raises :class:`TwinInputError` for a bad render."""
    if not render_dir.is_dir():
        raise TwinInputError(f"render directory {render_dir} does not exist (run `python -m infra.render` first)")
    manifests = render_dir / "manifests.yaml"
    if not manifests.is_file():
        raise TwinInputError(f"{manifests} does not exist: not a render directory")
    try:
        docs = [doc for doc in yaml.safe_load_all(manifests.read_text()) if doc]
    except yaml.YAMLError as err:
        raise TwinInputError(f"{manifests} is not valid YAML ({_where(err)})") from None
    services = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "RayService":
            continue
        metadata = dict(doc.get("metadata") or {})
        spec = doc.get("spec")
        if "name" not in metadata or not isinstance(spec, dict) or "rayClusterConfig" not in spec:
            raise TwinInputError(f"{manifests}: a RayService without metadata.name or spec.rayClusterConfig")
        services.append(
            RayServiceSpec(
                name=str(metadata["name"]),
                namespace=str(metadata.get("namespace", "default")),
                metadata=metadata,
                spec=spec,
            )
        )
    if not services:
        raise TwinInputError(f"{manifests} holds no RayService")
    return services


def model_names(stack_config: Path) -> dict[str, str]:
    """model_id -> model name, from the stack's config file (the names make the worker groups' names)."""
    if not stack_config.is_file():
        raise TwinInputError(f"stack config {stack_config} does not exist")
    try:
        doc = yaml.safe_load(stack_config.read_text()) or {}
    except yaml.YAMLError as err:
        raise TwinInputError(f"stack config {stack_config} is not valid YAML ({_where(err)})") from None
    config = (doc.get("config") or {}) if isinstance(doc, dict) else {}
    models = config.get(MODELS_KEY) or [] if isinstance(config, dict) else []
    return {
        str(m["model_id"]): str(m["name"]) for m in models if isinstance(m, dict) and "model_id" in m and "name" in m
    }
