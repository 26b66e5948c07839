"""The ports of a Ray pod, named once.

The RayService's container ports, the endpoint Service, the NetworkPolicies
and the PodMonitors all take their numbers and names from here, so a port can
not be renamed in one place and scraped or allowed under the old name in
another.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.inference_server.catalog import Layout


@dataclass(frozen=True)
class Port:
    """A named TCP port of a Ray container."""

    name: str
    number: int

    def container_port(self) -> dict[str, object]:
        """The `ports[]` entry of a container spec."""
        return {"name": self.name, "containerPort": self.number, "protocol": "TCP"}


@dataclass(frozen=True)
class RayPorts:
    """Every port a Ray head or worker pod listens on that anything outside the pod uses."""

    gcs: Port = Port("gcs-server", 6379)
    dashboard: Port = Port("dashboard", 8265)
    client: Port = Port("client", 10001)
    serve: Port = Port("serve", 8000)
    # Ray's metrics agent: Ray core, Serve and the vLLM engine metrics.
    metrics: Port = Port("metrics", 8080)
    # The autoscaler's and the dashboard's own Prometheus endpoints (head only).
    autoscaler_metrics: Port = Port("as-metrics", 44217)
    dashboard_metrics: Port = Port("dash-metrics", 44227)
    # vllm-server layout: the replica's own vLLM OpenAI server (the serve
    # Service's target) and vLLM's Prometheus registry, which answers without
    # an API key and so is for the monitoring stack alone.
    openai: Port = Port("openai", 8100)
    vllm_metrics: Port = Port("vllm-metrics", 8101)

    @property
    def wake(self) -> Port:
        """The head's Serve proxy under vllm-server, named so KubeRay keeps it out of the serve Service.

        The model gateway wakes a model at zero through it
        (vllm_server.VllmServer.__call__). It is Serve's own proxy port, so
        the same number as `serve`.
        """
        return Port("wake", self.serve.number)

    def head(self, layout: Layout = "serve-ingress", *, woken: bool = False) -> list[Port]:
        """Ports of the head container.

        Under vllm-server the head declares no `serve` port: KubeRay 1.7
        replaces a user serveService's ports with the head's ports named
        `serve`/`serve-*` when it finds any (common/service.go
        BuildServeService), which would point the load balancer at Serve's
        proxy instead of the replicas' `openai` port. The head's proxy still
        listens; for a model the gateway wakes (`woken`) it is declared as
        `wake`, which KubeRay's head Service carries and its serve Service
        does not.
        """
        ports = [self.gcs, self.dashboard, self.client, self.serve, self.metrics]
        if layout == "vllm-server":
            ports.remove(self.serve)
            if woken:
                ports.append(self.wake)
        return [*ports, self.autoscaler_metrics, self.dashboard_metrics]

    def worker(self) -> list[Port]:
        """Ports of a worker container (each runs a Serve proxy and a metrics agent)."""
        return [self.serve, self.metrics]

    def gpu_worker(self, layout: Layout) -> list[Port]:
        """Ports of a GPU worker container.

        Under vllm-server Serve runs its proxy on the head only, so a GPU
        worker listens on its vLLM server's two ports and Ray's metrics agent,
        not on `serve`.
        """
        if layout == "vllm-server":
            return [self.metrics, self.openai, self.vllm_metrics]
        return self.worker()

    def public(self, layout: Layout) -> Port:
        """The port the serve Service (the load balancer) and the batch workers send requests to."""
        return self.openai if layout == "vllm-server" else self.serve

    def internal(self) -> list[Port]:
        """Ports only the namespace itself and the monitoring stack may reach."""
        return [p for p in self.head() if p != self.serve]

    def scraped_on_head(self) -> list[Port]:
        """Ports Prometheus scrapes on a head pod."""
        return [self.metrics, self.autoscaler_metrics, self.dashboard_metrics]


RAY_PORTS = RayPorts()

# The load balancer's listener when it terminates TLS; without TLS it listens
# on the serve port's own number.
HTTPS_PORT = 443
