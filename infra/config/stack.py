"""The whole stack as one model: every section, and what the stack derives from them (its services and layouts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from infra.config.autoscaling import Autoscaling
from infra.config.batch import Batch
from infra.config.cluster import Cluster
from infra.config.endpoint import Endpoint
from infra.config.fields import Section
from infra.config.image import Image
from infra.config.models import Model
from infra.config.network import Network
from infra.config.node_groups import NodeGroups
from infra.config.observability import Observability
from infra.config.platform import Platform, Versions
from infra.config.ray import Ray
from infra.config.serving import Serving, longest_generation, vllm_server_problem
from infra.config.storage import Storage
from workloads.inference_server.catalog import Layout


class StackConfig(Section):
    """The whole stack, as `Pulumi.<stack>.yaml` describes it."""

    environment: Literal["dev", "staging", "prod"]
    region: str
    network: Network
    cluster: Cluster
    node_groups: NodeGroups
    versions: Versions = Versions()
    platform: Platform = Platform()
    storage: Storage
    ray: Ray = Ray()
    serving: Serving = Serving()
    models: list[Model] = Field(min_length=1)
    autoscaling: Autoscaling = Autoscaling()
    observability: Observability = Observability()
    endpoint: Endpoint = Endpoint()
    image: Image = Image()
    batch: Batch = Batch()

    @property
    def is_prod(self) -> bool:
        """Production rules apply."""
        return self.environment == "prod"

    def services(self) -> dict[str, list[Model]]:
        """RayService name -> the models it serves, in config order."""
        out: dict[str, list[Model]] = {}
        for model in self.models:
            out.setdefault(model.service_name, []).append(model)
        return out

    def layouts(self) -> dict[str, Layout]:
        """RayService name -> the layout it is served in (`serving.layout`, `auto` resolved)."""
        return {name: self.layout_of(name) for name in self.services()}

    def layout_of(self, service: str) -> Layout:
        """The layout of one RayService (by name)."""
        return self.layout_for(self.services()[service])

    def layout_for(self, models: list[Model]) -> Layout:
        """The layout of a RayService serving `models`: the configured one, or under `auto` the best it can use."""
        layout = self.serving.layout
        woken = self.serving.wakes_from_zero
        if layout == "serve-ingress" or (layout == "auto" and vllm_server_problem(models, woken=woken)):
            return "serve-ingress"
        return "vllm-server"

    def woken_services(self) -> list[str]:
        """The vllm-server RayServices whose model scales to zero: the model gateway wakes them."""
        return [
            name
            for name, models in self.services().items()
            if self.layout_for(models) == "vllm-server" and models[0].autoscaling.min_replicas == 0
        ]

    def uses_serve_ingress(self) -> bool:
        """Whether any RayService runs Serve LLM's OpenAI ingress (and so reads `serving.ingress`)."""
        return "serve-ingress" in self.layouts().values()


def longest_generation_seconds(cfg: StackConfig) -> float:
    """The longest request the limits allow, at the SLO: first token, then max_tokens tokens at the p95 pace."""
    return longest_generation(cfg.serving.limits, cfg.observability.slo)
