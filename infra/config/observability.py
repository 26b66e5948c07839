"""The `observability` section: Prometheus, the SLOs the alerts hold, where alerts page, and traces."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, ConfigDict, Field

from infra.config.fields import Duration, K8sName, Section
from workloads.inference_server.catalog import Tracing as CatalogTracing


class Slo(Section):
    """Service levels the alerts hold the platform to."""

    ttft_p95_seconds: float = Field(default=2.0, gt=0)
    inter_token_p95_seconds: float = Field(default=0.15, gt=0)
    error_ratio: float = Field(default=0.01, gt=0, lt=1)
    requests_waiting: int = Field(default=20, ge=1)
    kv_cache_usage: float = Field(default=0.9, gt=0, le=1)
    gpu_idle_minutes: int = Field(default=30, ge=5)


class Tracing(CatalogTracing):
    """OpenTelemetry traces to the team's own collector; off unless `otlp_endpoint` is set.

    The server's own catalogue schema (catalog.Tracing), so the program and
    the server read the same rules: `otlp_endpoint` is scheme://host:port of
    an OTLP/gRPC collector (http:// or grpc:// plaintext, https:// TLS), e.g.
    `http://otel-collector.monitoring:4317`. vLLM (both layouts) gets it as
    its `otlp_traces_endpoint`; serve-ingress services also trace Serve's
    replicas (`sample_ratio` of the requests); the Ray pods may then reach
    that port. No stack sets it: each team names its collector.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


def _runbook_base_url(value: str) -> str:
    # Each alert's link is <base>/<AlertName>.md: a query or fragment would
    # end up before the page's name, and a link without a host does not open
    # from a page in Slack or PagerDuty.
    parts = urlsplit(value)
    opens = parts.scheme in ("http", "https") and parts.netloc and not (parts.query or parts.fragment)
    if not opens or any(c.isspace() for c in value):
        raise ValueError(
            f"'{value}' is not a base URL for the runbooks: http(s)://host/path with no query or fragment, "
            "where docs/runbooks/ is served (each alert links <base>/<AlertName>.md)"
        )
    return value


class Observability(Section):
    """Prometheus, Grafana, the SLOs and (optionally) traces."""

    prometheus_retention: Duration = "15d"
    prometheus_storage_gib: int = Field(default=100, ge=10)
    slo: Slo = Slo()
    # A Secret in the monitoring namespace holding `alertmanager.yaml` (the
    # routes and receivers that page: PagerDuty, Opsgenie, Slack keys), kept
    # by the team's secret tooling; without it alerts only show in Alertmanager.
    alertmanager_config_secret: K8sName | None = None
    # Where this repository's docs/runbooks/ is served, e.g.
    # https://github.com/<org>/<repo>/blob/main/docs/runbooks: every alert's
    # `runbook_url` is <base>/<AlertName>.md. Unset, it is the page's path in
    # the repository, docs/runbooks/<AlertName>.md.
    runbook_base_url: Annotated[str, AfterValidator(_runbook_base_url)] | None = None
    tracing: Tracing = Tracing()
