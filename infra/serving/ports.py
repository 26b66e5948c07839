"""The ports of a Ray pod, named once.

The RayService's container ports, the endpoint Service, the NetworkPolicies
and the PodMonitors all take their numbers and names from here, so a port can
not be renamed in one place and scraped or allowed under the old name in
another.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def head(self) -> list[Port]:
        """Ports of the head container."""
        return [
            self.gcs,
            self.dashboard,
            self.client,
            self.serve,
            self.metrics,
            self.autoscaler_metrics,
            self.dashboard_metrics,
        ]

    def worker(self) -> list[Port]:
        """Ports of a worker container (each runs a Serve proxy and a metrics agent)."""
        return [self.serve, self.metrics]

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
