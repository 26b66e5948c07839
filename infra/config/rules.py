"""The cross-field rules: `check_rules` runs every rule, section by section; the ones across sections are here.

A section's own rules sit beside its fields (node_groups.py, models.py,
serving.py, ...); this module holds those that judge several sections at
once: the node provisioner, the names, who may reach the endpoints, what an
existing cluster changes, and the room a NewCluster upgrade needs. The
cold-start, fairness and ARN rules have modules of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.capacity.upgrade import Fleet, UpgradeHeadroom, UpgradeNeed, headroom_problem
from infra.config.arns import check_arns
from infra.config.autoscaling import check_prescale
from infra.config.batch import check_batch
from infra.config.cluster import check_kubernetes_version
from infra.config.cold_start import check_cold_start
from infra.config.endpoint import check_dns
from infra.config.fairness import check_fairness
from infra.config.fields import dns_label
from infra.config.gateway import check_gateway
from infra.config.models import RAY_SERVICE_NAME_MAX, Model, check_model, check_parallelism, nodes_per_replica
from infra.config.network import check_network, cidr_list_problem
from infra.config.node_groups import GpuNodeGroupSettings, check_gpu_group, check_node_group, usable_group
from infra.config.problems import Problem
from infra.config.routing import check_routing
from infra.config.serving import check_ingress, check_layout, check_limits
from infra.config.stack import StackConfig
from infra.instance_types import GpuInstanceType


def check_rules(cfg: StackConfig) -> list[Problem]:
    """Every cross-field rule; an empty list means the config is usable."""
    problems: list[Problem] = []
    problems += _check_provisioner(cfg)
    problems += check_node_group("node_groups.system", cfg.node_groups.system)
    gpu_groups: dict[str, GpuNodeGroupSettings] = {}
    for i, group in enumerate(cfg.node_groups.gpu):
        problems += check_gpu_group(i, group)
        gpu_groups.setdefault(group.name, group)
    for i, model in enumerate(cfg.models):
        problems += check_model(
            i,
            model,
            gpu_groups,
            model_bucket=cfg.storage.model_bucket,
            is_prod=cfg.is_prod,
            allow_hub_download=cfg.serving.allow_hub_download,
            limits=cfg.serving.limits,
        )
    problems += _check_upgrade_headroom(cfg, gpu_groups)
    problems += _check_names(cfg)
    problems += _check_access(cfg)
    problems += check_dns(cfg.endpoint, external_dns=cfg.platform.external_dns.enabled)
    problems += check_arns(cfg)
    problems += _check_cluster_mode(cfg)
    problems += check_network(cfg.network, cfg.region, eks=cfg.cluster.mode == "eks")
    problems += check_kubernetes_version(cfg.cluster)
    problems += check_prescale(cfg.autoscaling.prescale, gpu_groups)
    problems += check_cold_start(cfg, gpu_groups)
    problems += check_limits(cfg.serving.limits, cfg.models)
    problems += check_fairness(cfg)
    problems += check_batch(cfg.batch, [m.model_id for m in cfg.models], cfg.serving.limits, cfg.observability.slo)
    problems += check_layout(cfg.serving, cfg.services().values())
    # Without a serve-ingress service there is no OpenAI ingress to protect:
    # `serving.ingress` is then read by nothing.
    if cfg.uses_serve_ingress():
        problems += check_ingress(cfg.serving.ingress, is_prod=cfg.is_prod)
    problems += check_routing(cfg.serving.routing, cfg.layouts(), is_prod=cfg.is_prod)
    at_zero = {m.service_name for m in cfg.models if m.autoscaling.min_replicas == 0}
    problems += check_gateway(
        cfg.serving.gateway, cfg.serving.routing, cfg.layouts(), is_prod=cfg.is_prod, scales_to_zero=at_zero
    )
    return problems


def _check_provisioner(cfg: StackConfig) -> Iterable[Problem]:
    """Karpenter launches nodes for a cluster made here; only Karpenter launches into capacity reservations."""
    if cfg.cluster.node_provisioner == "karpenter":
        if cfg.cluster.mode == "existing":
            yield Problem(
                "cluster.node_provisioner",
                "karpenter needs cluster.mode: eks (an existing cluster's nodes are not made by this program)",
            )
        return
    for i, group in enumerate(cfg.node_groups.gpu):
        if group.capacity_reservation_ids:
            yield Problem(
                f"node_groups.gpu[{i}].capacity_reservation_ids",
                "needs cluster.node_provisioner: karpenter (managed node groups here do not target reservations)",
            )


def _check_names(cfg: StackConfig) -> Iterable[Problem]:
    named: list[tuple[str, str]] = [
        ("cluster.name", cfg.cluster.name),
        ("node_groups.system.name", cfg.node_groups.system.name),
        ("serving.namespace", cfg.serving.namespace),
        ("storage.storage_class.name", cfg.storage.storage_class.name),
        ("image.repository_name", cfg.image.repository_name),
    ]
    if cfg.observability.alertmanager_config_secret:
        named.append(("observability.alertmanager_config_secret", cfg.observability.alertmanager_config_secret))
    named += [(f"node_groups.gpu[{i}].name", g.name) for i, g in enumerate(cfg.node_groups.gpu)]
    named += [(f"autoscaling.prescale[{i}].name", p.name) for i, p in enumerate(cfg.autoscaling.prescale)]
    for i, model in enumerate(cfg.models):
        named.append((f"models[{i}].name", model.name))
        if model.service is not None:
            named.append((f"models[{i}].service", model.service))
    for path, value in named:
        try:
            dns_label(value)
        except ValueError as err:
            yield Problem(path, str(err))
    for i, model in enumerate(cfg.models):
        if len(model.service_name) > RAY_SERVICE_NAME_MAX:
            key = "service" if model.service else "name"
            yield Problem(
                f"models[{i}].{key}",
                f"RayService name '{model.service_name}' has {len(model.service_name)} characters "
                f"(at most {RAY_SERVICE_NAME_MAX})",
            )
    for label, items in (
        ("name", [m.name for m in cfg.models]),
        ("model_id", [m.model_id for m in cfg.models]),
    ):
        seen: set[str] = set()
        for i, value in enumerate(items):
            if value in seen:
                yield Problem(f"models[{i}].{label}", f"'{value}' is used by another model")
            seen.add(value)
    seen = set()
    for i, group in enumerate(cfg.node_groups.gpu):
        if group.name in seen or group.name == cfg.node_groups.system.name:
            yield Problem(f"node_groups.gpu[{i}].name", f"'{group.name}' is used by another node group")
        seen.add(group.name)


def _check_access(cfg: StackConfig) -> Iterable[Problem]:
    ep = cfg.endpoint
    for key, cidrs in (
        ("endpoint.allowed_cidrs", ep.allowed_cidrs),
        ("cluster.public_access_cidrs", cfg.cluster.public_access_cidrs),
    ):
        problem = cidr_list_problem(cidrs)
        if problem:
            yield Problem(key, problem)
    if not ep.certificate_arn and ep.scheme == "internal":
        # No TLS: requests and their API keys cross the network in clear, so
        # only private networks may reach the endpoint (an internet-facing one
        # needs a certificate, below). With no list the load balancer admits
        # the VPC alone (infra/serving/endpoint.py source_ranges).
        public = [str(c) for c in ep.allowed_cidrs if not c.is_private]
        if public:
            yield Problem(
                "endpoint.allowed_cidrs",
                f"{', '.join(public)} is not a private range: without endpoint.certificate_arn the endpoint "
                "serves plain HTTP, and API keys must not cross public networks in clear",
            )
    if ep.scheme == "internet-facing":
        if cfg.is_prod and not ep.allowed_cidrs:
            yield Problem(
                "endpoint.allowed_cidrs", "prod may not use an internet-facing endpoint without an allow-list"
            )
        if not ep.certificate_arn:
            yield Problem(
                "endpoint.certificate_arn",
                "an internet-facing endpoint needs a TLS certificate (API keys must not cross the internet in clear)",
            )
    cl = cfg.cluster
    if cl.mode == "eks":
        if not (cl.endpoint_public_access or cl.endpoint_private_access):
            yield Problem("cluster.endpoint_private_access", "the API server needs public or private access")
        # 0.0.0.0/0 (or any list as wide) is refused above, for every stack.
        if cl.endpoint_public_access and not cl.public_access_cidrs:
            yield Problem(
                "cluster.public_access_cidrs",
                "a public API server endpoint needs a CIDR allow-list without 0.0.0.0/0",
            )
        if cfg.is_prod and cl.endpoint_public_access:
            yield Problem("cluster.endpoint_public_access", "prod keeps the API server endpoint private")


def _check_cluster_mode(cfg: StackConfig) -> Iterable[Problem]:
    if cfg.cluster.mode == "existing":
        if not cfg.cluster.kubeconfig_context:
            yield Problem("cluster.kubeconfig_context", "required when cluster.mode is existing")
        if cfg.ray.gcs_fault_tolerance.enabled:
            yield Problem(
                "ray.gcs_fault_tolerance.enabled",
                "the Redis for GCS fault tolerance is created in the program's VPC, so only with cluster.mode eks",
            )
        return
    for part, toggle in cfg.platform:
        if not toggle.enabled:
            yield Problem(f"platform.{part}.enabled", "may be off only with cluster.mode existing")
    if cfg.cluster.kubeconfig_context:
        yield Problem("cluster.kubeconfig_context", "only used with cluster.mode existing")
    if cfg.is_prod and cfg.platform.monitoring.enabled and not cfg.observability.alertmanager_config_secret:
        yield Problem(
            "observability.alertmanager_config_secret",
            "prod alerts must page: name the Secret that holds alertmanager.yaml",
        )
    if cfg.is_prod and not cfg.ray.gcs_fault_tolerance.enabled:
        yield Problem(
            "ray.gcs_fault_tolerance.enabled",
            "prod needs GCS fault tolerance so a Ray head restart does not drop serving",
        )


def _fits_once(model: Model, gpu: GpuInstanceType, group: GpuNodeGroupSettings) -> bool:
    """The model's parallelism is valid for the group and its minimum replicas fit the group once."""
    if list(check_parallelism("", model, gpu)):
        return False
    return model.autoscaling.min_replicas * nodes_per_replica(model, gpu) <= group.max_size


def upgrade_need(cfg: StackConfig, group: GpuNodeGroupSettings, headroom: UpgradeHeadroom | None = None) -> UpgradeNeed:
    """What `group` holds while every model on it upgrades at once, under `headroom` (else ray.upgrade_headroom)."""
    return UpgradeNeed(
        group=group.name,
        headroom=cfg.ray.upgrade_headroom if headroom is None else headroom,
        instance=group.instance(),
        fleets=tuple(Fleet(m.name, m.num_devices, m.autoscaling) for m in cfg.models if m.gpu_group == group.name),
    )


def _check_upgrade_headroom(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    """A NewCluster upgrade runs the old and the new cluster side by side: each group's max_size holds both.

    The old cluster counts at max_replicas or min_replicas as
    ray.upgrade_headroom says, the new one at its starting replicas
    (infra/capacity/upgrade.py). A change that reaches every RayService (a new
    image) upgrades them all at once, so every model of a group counts. A group
    whose models do not fit even once is reported by the model rules instead.
    """
    if cfg.ray.upgrade_strategy != "NewCluster":
        return
    for i, group in enumerate(cfg.node_groups.gpu):
        models = [m for m in cfg.models if m.gpu_group == group.name]
        if groups.get(group.name) is not group or not usable_group(group) or not models:
            continue
        if not all(_fits_once(m, group.instance(), group) for m in models):
            continue
        problem = headroom_problem(upgrade_need(cfg, group), group.max_size)
        if problem:
            yield Problem(f"node_groups.gpu[{i}].max_size", problem)
