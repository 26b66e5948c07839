"""The `image` section: the serving image the Ray pods run."""

from __future__ import annotations

from pydantic import Field

from infra.config.fields import K8sName, Section


class Image(Section):
    """The serving image: built from workloads/ or given by digest."""

    reference: str | None = Field(default=None, pattern=r"^[^@\s]+@sha256:[0-9a-f]{64}$")
    repository_name: K8sName = "llm-serving"
