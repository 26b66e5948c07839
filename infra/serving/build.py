"""Builds the serving layer: namespace, autoscaling, RayServices, alerts, dashboards, endpoint."""

from __future__ import annotations

import pulumi

from infra.aws.layer import AwsLayer
from infra.cluster_services.layer import PlatformLayer
from infra.config import StackConfig, preemption_free_sequences
from infra.serving import kuberay
from infra.serving.alerts import ServeQueue, ServingAlerts, ServingAlertsArgs, wake_for_minutes
from infra.serving.autoscaler_scope import AutoscalerScopeArgs, RayAutoscalerScope
from infra.serving.autoscaling import ServingAutoscaling, ServingAutoscalingArgs
from infra.serving.batch import BatchWorkers, BatchWorkersArgs
from infra.serving.dashboards import ServingDashboards, ServingDashboardsArgs
from infra.serving.endpoint import ServingEndpoint, ServingEndpointArgs, serve_service_spec
from infra.serving.gateway import GATEWAY_LABEL, ModelGateway, ModelGatewayArgs, gateway_plan, woken_cold_starts
from infra.serving.layer import ServingLayer
from infra.serving.namespace import ServingNamespace, ServingNamespaceArgs
from infra.serving.network import ClusterPeers
from infra.serving.ports import RAY_PORTS
from infra.serving.ray_service import VllmRayService, VllmRayServiceArgs
from infra.serving.replicated import DeploymentSite
from infra.serving.router import RequestRouter, RequestRouterArgs, router_plans
from workloads.inference_server.catalog import serve_llm_deployment_name


def dashboard_access(namespace: str, ray_service: str) -> str:
    """How a user reaches a RayService's Ray dashboard (it is never exposed)."""
    port = RAY_PORTS.dashboard.number
    return f"kubectl -n {namespace} port-forward svc/{kuberay.head_service(ray_service)} {port}"


def cluster_peers(cfg: StackConfig, platform: PlatformLayer) -> ClusterPeers:
    """Who the serving NetworkPolicies let in or out, from the platform layer and the VPC."""
    return ClusterPeers(
        operator=platform.kuberay_operator,
        prometheus=platform.prometheus,
        grafana=platform.grafana,
        vpc_cidr=str(cfg.network.vpc_cidr),
    )


def batch_service(cfg: StackConfig) -> str | None:
    """The RayService the batch workers send to, when batch is on."""
    if not cfg.batch.enabled:
        return None
    return next(m.service_name for m in cfg.models if m.model_id == cfg.batch.model)


def _after(aws: AwsLayer, *resources: pulumi.Resource | None) -> pulumi.ResourceOptions:
    """Options for a serving component: the cluster's provider, after `resources` (Nones skipped)."""
    return pulumi.ResourceOptions(provider=aws.provider, depends_on=[r for r in resources if r is not None])


def _ray_services(
    cfg: StackConfig,
    aws: AwsLayer,
    platform: PlatformLayer,
    ns: ServingNamespace,
    autoscaling: ServingAutoscaling,
    scope: RayAutoscalerScope,
) -> dict[str, VllmRayService]:
    """One RayService per `service`, after the namespace, the priority classes and the ray.io CRDs.

    The load balancer controller's webhook must see the serve Service KubeRay creates.
    """
    namespace = cfg.serving.namespace
    after = [*ns.ready, *autoscaling.priority_classes, platform.ray_crds, platform.load_balancer_controller, scope]
    return {
        name: VllmRayService(
            name,
            VllmRayServiceArgs(
                cfg=cfg,
                name=name,
                models=models,
                namespace=namespace,
                image=aws.image,
                system=aws.system,
                gpu=aws.gpu,
                model_reader_service_account=ns.service_account,
                api_keys_secret=ns.api_keys_secret,
                storage_class=platform.storage_class,
                prometheus_url=platform.prometheus_url,
                grafana_url=platform.grafana_url,
                serving_priority_class=autoscaling.serving_priority_class,
                serve_service=serve_service_spec(name, namespace, cfg.layout_of(name)),
                redis=aws.redis,
                redis_secret=ns.redis_secret,
            ),
            _after(aws, *after),
        )
        for name, models in cfg.services().items()
    }


def _batch_workers(cfg: StackConfig, aws: AwsLayer, platform: PlatformLayer, ns: ServingNamespace) -> None:
    """Queue-fed batch workers, scaled by KEDA on the backlog."""
    if aws.batch_queue is None or aws.batch_worker is None:
        raise ValueError("batch is enabled but the AWS layer made no batch queue or worker identity")
    namespace = cfg.serving.namespace
    service = batch_service(cfg)
    if service is None:
        raise ValueError("batch is enabled but no model serves batch.model")
    if ns.batch_api_key_secret is None:
        raise ValueError("batch is enabled but the serving namespace made no key for the batch workers")
    BatchWorkers(
        "batch-workers",
        BatchWorkersArgs(
            settings=cfg.batch,
            queue=aws.batch_queue,
            identity=aws.batch_worker,
            namespace=namespace,
            image=aws.image,
            system=aws.system,
            api_key_secret=ns.batch_api_key_secret,
            serve_service=serve_service_spec(service, namespace, cfg.layout_of(service)),
            vpc_cidr=str(cfg.network.vpc_cidr),
            serve_port=RAY_PORTS.public(cfg.layout_of(service)),
        ),
        _after(aws, *ns.ready, platform.keda_crds),
    )


def serve_queues(cfg: StackConfig) -> dict[str, ServeQueue]:
    """Where each serve-ingress model's requests wait in Serve: the RayService's one application (its name,
    serve_config) and the model's deployment in it, as Ray Serve LLM names it."""
    return {
        model.model_id: ServeQueue(cfg.serving.namespace, service, serve_llm_deployment_name(model.model_id))
        for service, models in cfg.services().items()
        if cfg.layout_of(service) == "serve-ingress"
        for model in models
    }


def _observability(cfg: StackConfig, aws: AwsLayer, platform: PlatformLayer, ns: ServingNamespace) -> None:
    """Alert rules (after the monitoring CRDs) and dashboards."""
    ServingAlerts(
        "serving-alerts",
        ServingAlertsArgs(
            namespace=cfg.serving.namespace,
            slo=cfg.observability.slo,
            prometheus_selector_labels=dict(platform.prometheus_selector_labels),
            vllm_servers=[name for name, layout in cfg.layouts().items() if layout == "vllm-server"],
            runbook_base_url=cfg.observability.runbook_base_url,
            preemption_free=preemption_free_sequences(cfg),
            serve_queues=serve_queues(cfg),
            wake_minutes=wake_for_minutes(woken_cold_starts(cfg).values()),
        ),
        _after(aws, *ns.ready, platform.monitoring_crds),
    )
    ServingDashboards(
        "serving-dashboards",
        ServingDashboardsArgs(
            monitoring_namespace=platform.monitoring_namespace, dashboard_label=platform.dashboard_label
        ),
        _after(aws, *aws.cluster_ready),
    )


def _site(cfg: StackConfig, aws: AwsLayer, platform: PlatformLayer) -> DeploymentSite:
    """Where the serving layer's own Deployments (routers, gateway) run, and who is around them."""
    return DeploymentSite(
        namespace=cfg.serving.namespace,
        image=aws.image,
        system=aws.system,
        peers=cluster_peers(cfg, platform),
        prometheus_selector_labels=dict(platform.prometheus_selector_labels),
    )


def _routers(
    cfg: StackConfig,
    aws: AwsLayer,
    platform: PlatformLayer,
    ns: ServingNamespace,
    ray_services: dict[str, VllmRayService],
) -> dict[str, RequestRouter]:
    """A router in front of each vllm-server RayService, when `serving.routing` is on.

    After its RayService (its pods turn Ready once a replica is) and the
    monitoring CRDs (its PodMonitor).
    """
    if not cfg.serving.routing.enabled:
        return {}
    # The AWS layer copies the front whenever routing is on (infra/aws/front_image.py).
    assert aws.router_front_image is not None
    routers = {}
    for service, plan in router_plans(cfg).items():
        routers[service] = RequestRouter(
            f"{service}-router",
            RequestRouterArgs(
                service=service,
                routing=cfg.serving.routing,
                plan=plan,
                site=_site(cfg, aws, platform),
                front_image=aws.router_front_image,
                gateway_pods=GATEWAY_LABEL if cfg.serving.gateway.enabled else None,
            ),
            _after(aws, *ns.ready, platform.monitoring_crds, ray_services[service].ray_service),
        )
    return routers


def _gateway(
    cfg: StackConfig,
    aws: AwsLayer,
    platform: PlatformLayer,
    ns: ServingNamespace,
    routers: dict[str, RequestRouter],
) -> ModelGateway | None:
    """One address for every model, in front of their routers, when `serving.gateway` is on."""
    if not cfg.serving.gateway.enabled:
        return None
    return ModelGateway(
        cfg.serving.gateway.name,
        ModelGatewayArgs(
            gateway=cfg.serving.gateway,
            endpoint=cfg.endpoint,
            plan=gateway_plan(cfg),
            site=_site(cfg, aws, platform),
            api_keys_secret=ns.api_keys_secret,
        ),
        _after(aws, *ns.ready, platform.monitoring_crds, *(router.deployment for router in routers.values())),
    )


def _service_urls(
    cfg: StackConfig, endpoint: ServingEndpoint, gateway: ModelGateway | None
) -> dict[str, pulumi.Output[str]]:
    """Each RayService's base URL: its own load balancer's, or for a model the gateway wakes the gateway's.

    A woken model's own load balancer leads to a router with no replica while
    it is at zero; only the gateway holds the request that wakes it.
    """
    urls = dict(endpoint.urls)
    if gateway is not None:
        urls |= {name: gateway.url for name in cfg.woken_services()}
    return urls


def build_serving(
    cfg: StackConfig, api_keys: pulumi.Output[str], aws: AwsLayer, platform: PlatformLayer
) -> ServingLayer:
    """Declare the serving layer on the cluster the AWS layer made or found."""
    namespace = cfg.serving.namespace
    services = cfg.services()
    ns_args = ServingNamespaceArgs(namespace, aws.model_reader, api_keys, aws.redis, batch_key=cfg.batch.enabled)
    ns = ServingNamespace("serving", ns_args, _after(aws, *aws.cluster_ready))
    autoscaling = ServingAutoscaling(
        "serving-autoscaling",
        ServingAutoscalingArgs(
            namespace=namespace,
            prescale=list(cfg.autoscaling.prescale),
            gpu=aws.gpu,
            services=services,
            ingress_min_replicas=cfg.serving.ingress.min_replicas,
            gcs_fault_tolerant=aws.redis is not None,
            layouts=cfg.layouts(),
        ),
        _after(aws, *ns.ready, platform.keda_crds),
    )
    # Before any RayCluster exists: each autoscaler may change only its own cluster.
    scope = RayAutoscalerScope("ray-autoscaler-scope", AutoscalerScopeArgs(namespace=namespace), _after(aws, *ns.ready))
    ray_services = _ray_services(cfg, aws, platform, ns, autoscaling, scope)
    if cfg.batch.enabled:
        _batch_workers(cfg, aws, platform, ns)
    _observability(cfg, aws, platform, ns)
    routers = _routers(cfg, aws, platform, ns, ray_services)
    gateway = _gateway(cfg, aws, platform, ns, routers)
    endpoint = ServingEndpoint(
        "serving-endpoint",
        ServingEndpointArgs(
            namespace=namespace,
            endpoint=cfg.endpoint,
            ray_services={name: rs.ray_service for name, rs in ray_services.items()},
            peers=cluster_peers(cfg, platform),
            gcs_redis=aws.redis is not None,
            batch_service=batch_service(cfg),
            layouts=cfg.layouts(),
            otlp_port=cfg.observability.tracing.port,
            routers={name: router.pod_labels for name, router in routers.items()},
            woken_by={name: gateway.pod_labels for name in cfg.woken_services()} if gateway is not None else {},
        ),
        _after(aws, *ns.ready, *(router.deployment for router in routers.values())),
    )
    # The first RayService in config order is the stack's `endpoint`.
    urls = _service_urls(cfg, endpoint, gateway)
    first = next(iter(services))
    return ServingLayer(
        endpoint=urls[first],
        models=[m.model_id for m in cfg.models],
        ray_dashboards={name: dashboard_access(namespace, name) for name in services},
        endpoints=urls,
        service_models={name: [m.model_id for m in models] for name, models in services.items()},
        load_balancers=endpoint.hostnames,
        gateway=gateway.url if gateway is not None else None,
    )
