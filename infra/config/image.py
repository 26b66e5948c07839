"""The `image` section: the serving image the Ray pods run."""

from __future__ import annotations

from pydantic import Field

from infra.config.fields import K8sName, Section

# `<repository>@sha256:<64 hex>`: what a pod runs whatever a tag is moved to.
DIGEST_REFERENCE = r"^[^@\s]+@sha256:[0-9a-f]{64}$"


class Image(Section):
    """The serving image: built from workloads/ or given by digest."""

    reference: str | None = Field(default=None, pattern=DIGEST_REFERENCE)
    # The routers' front (nginx), when `serving.routing` is on: by default the
    # stack copies it into an ECR repository of its own and runs that digest
    # (infra/aws/front_image.py); a digest given here is run instead.
    router_front_reference: str | None = Field(default=None, pattern=DIGEST_REFERENCE)
    repository_name: K8sName = "llm-serving"
