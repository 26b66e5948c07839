"""The platform layer under mocks: releases, ordering, identities, toggles.

Builds the layer with a hand-made AwsLayer (the placements and pod
identities the AWS layer would hand down) so it is tested on its own, for
the dev and prod stack files and variants of them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pulumi
import pytest

from infra import versions
from infra.aws import policies
from infra.aws.identities import external_dns_zone
from infra.aws.layer import ExternalDnsAccess, PodIdentity
from infra.cluster_services import load_balancer, monitoring
from infra.render import SECRET, run_under_mocks
from infra.scheduling import GPU_OPERATOR_DEVICE_PLUGIN_LABEL, GPU_TAINT, gpu_placements, system_placement
from tests.harness import (
    CA_IDENTITY,
    CLUSTER_READY,
    CRD_GROUPS,
    LBC_IDENTITY,
    PlatformRender,
    fake_aws,
    render_platform,
    stack_config,
    stack_render,
)


def _existing(parts_off: list[str]) -> Any:
    def edit(c: dict[str, Any]) -> None:
        c["llm-platform:cluster"]["mode"] = "existing"
        c["llm-platform:cluster"]["kubeconfig_context"] = "ops"
        c["llm-platform:ray"] = {**c.get("llm-platform:ray", {}), "gcs_fault_tolerance": {"enabled": False}}
        c["llm-platform:platform"] = {p: {"enabled": False} for p in parts_off}

    return edit


STACKS = ["dev", "prod"]
# external-dns runs only where the endpoint has a domain and its hosted zone.
DOMAIN_CHARTS = {versions.EXTERNAL_DNS.chart}
# Karpenter runs only where the AWS layer made its identity and queue (the
# karpenter provisioner on a new cluster; tests/test_platform_karpenter.py).
ALL_CHARTS = {c.chart for c in versions.HELM_CHARTS} - DOMAIN_CHARTS - {versions.KARPENTER.chart}


# --- versions --------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_every_chart_is_released_at_its_pinned_exact_version(stack: str) -> None:
    releases = stack_render(stack).releases()
    assert set(releases) == ALL_CHARTS
    for chart in versions.HELM_CHARTS:
        if chart.chart not in releases:
            continue
        inputs = releases[chart.chart]["inputs"]
        assert inputs["version"] == chart.version
        assert inputs["repositoryOpts"]["repo"] == chart.repository
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", inputs["version"]), f"{chart.chart}: not an exact version"


def test_pinned_versions_are_the_ones_the_issue_names() -> None:
    # Bumping any of these is a reviewed change that also needs the CRD step.
    assert versions.GPU_OPERATOR.version == "v26.7.0"
    assert versions.KUBERAY_OPERATOR.version == "1.7.0"
    assert versions.KUBE_PROMETHEUS_STACK.version == "88.5.3"
    assert versions.KEDA.version == "2.20.2"
    assert versions.CLUSTER_AUTOSCALER.version == "9.59.0"
    assert versions.AWS_LOAD_BALANCER_CONTROLLER.version == "3.5.0"
    assert versions.EXTERNAL_DNS.version == "1.21.1"


@pytest.mark.parametrize("stack", STACKS)
def test_releases_have_fixed_names_and_own_namespaces(stack: str) -> None:
    render = stack_render(stack)
    namespaces = {n["inputs"]["metadata"]["name"] for n in render.of_type("kubernetes:core/v1:Namespace")}
    expected = {
        "gpu-operator": "gpu-operator",
        "kuberay-operator": "kuberay",
        "kube-prometheus-stack": "monitoring",
        "keda": "keda",
        "cluster-autoscaler": CA_IDENTITY.namespace,
        "aws-load-balancer-controller": LBC_IDENTITY.namespace,
    }
    for chart, release in render.releases().items():
        assert release["inputs"]["namespace"] == expected[chart]
        assert release["inputs"]["name"] == chart
        assert release["inputs"]["createNamespace"] is False
        if expected[chart] != "kube-system":
            assert expected[chart] in namespaces
            assert f"{expected[chart]}-namespace" in render.waits_for(release)
    assert "kube-system" not in namespaces


# --- ordering --------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_every_release_waits_for_the_cluster(stack: str) -> None:
    render = stack_render(stack)
    for chart, release in render.releases().items():
        assert CLUSTER_READY in render.waits_for(release), chart


@pytest.mark.parametrize("stack", STACKS)
def test_charts_with_service_monitors_wait_for_the_monitoring_crds(stack: str) -> None:
    render = stack_render(stack)
    releases = render.releases()
    monitoring = releases["kube-prometheus-stack"]["name"]
    for chart in ALL_CHARTS - {"kube-prometheus-stack"}:
        waits = render.waits_for(releases[chart])
        assert monitoring in waits, f"{chart} renders a ServiceMonitor before its CRD exists"


@pytest.mark.parametrize("stack", STACKS)
def test_services_are_created_after_the_load_balancer_webhook(stack: str) -> None:
    render = stack_render(stack)
    releases = render.releases()
    lbc = releases["aws-load-balancer-controller"]["name"]
    for chart in ALL_CHARTS - {"kube-prometheus-stack", "aws-load-balancer-controller"}:
        assert lbc in render.waits_for(releases[chart]), chart


@pytest.mark.parametrize("stack", STACKS)
def test_layer_hands_down_the_release_installing_each_crd_group(stack: str) -> None:
    render = stack_render(stack)
    releases = {chart: r["name"] for chart, r in render.releases().items()}
    assert render.layer["ray_crds"] == releases[CRD_GROUPS["ray.io"]]
    assert render.layer["monitoring_crds"] == releases[CRD_GROUPS["monitoring.coreos.com"]]
    assert render.layer["keda_crds"] == releases[CRD_GROUPS["keda.sh"]]
    assert render.layer["load_balancer_controller"] == releases["aws-load-balancer-controller"]


@pytest.mark.parametrize("stack", STACKS)
def test_custom_resources_depend_on_the_release_installing_their_crd(stack: str) -> None:
    render = stack_render(stack)
    releases = {chart: r["name"] for chart, r in render.releases().items()}
    for r in render.resources:
        group = r["type"].removeprefix("kubernetes:").split("/")[0]
        if group in CRD_GROUPS:
            assert releases[CRD_GROUPS[group]] in r["depends_on"], r["name"]


@pytest.mark.parametrize("stack", STACKS)
def test_prometheus_waits_for_its_storage_class(stack: str) -> None:
    render = stack_render(stack)
    assert "storage-class-class" in render.waits_for(render.releases()["kube-prometheus-stack"])


# --- identities, placement ---------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_service_accounts_are_the_pod_identities(stack: str) -> None:
    render = stack_render(stack)
    ca = render.releases()["cluster-autoscaler"]
    assert ca["inputs"]["namespace"] == CA_IDENTITY.namespace
    assert ca["inputs"]["values"]["rbac"]["serviceAccount"] == {
        "create": True,
        "name": CA_IDENTITY.service_account,
    }
    lbc = render.releases()["aws-load-balancer-controller"]
    assert lbc["inputs"]["namespace"] == LBC_IDENTITY.namespace
    assert lbc["inputs"]["values"]["serviceAccount"] == {"create": True, "name": LBC_IDENTITY.service_account}
    # Pod Identity binds the role: no IRSA annotation anywhere.
    assert "annotations" not in ca["inputs"]["values"]["rbac"]["serviceAccount"]


def test_identities_in_another_namespace_are_followed_and_declared_once() -> None:
    ca = PodIdentity("platform-system", "ca", None)
    lbc = PodIdentity("platform-system", "lbc", None)
    render = render_platform(stack_config("dev"), cluster_autoscaler=ca, load_balancer_controller=lbc)
    releases = render.releases()
    assert releases["cluster-autoscaler"]["inputs"]["namespace"] == "platform-system"
    assert releases["cluster-autoscaler"]["inputs"]["values"]["rbac"]["serviceAccount"]["name"] == "ca"
    assert releases["aws-load-balancer-controller"]["inputs"]["values"]["serviceAccount"]["name"] == "lbc"
    names = [n["inputs"]["metadata"]["name"] for n in render.of_type("kubernetes:core/v1:Namespace")]
    assert names.count("platform-system") == 1


@pytest.mark.parametrize("stack", STACKS)
def test_cluster_autoscaler_settings_come_from_config(stack: str) -> None:
    cfg = stack_config(stack)
    values = stack_render(stack).values("cluster-autoscaler")
    assert values["autoDiscovery"]["clusterName"] == cfg.cluster.name
    assert values["awsRegion"] == cfg.region
    assert values["image"]["tag"] == versions.CLUSTER_AUTOSCALER_IMAGE_TAG
    auto = cfg.autoscaling.cluster
    assert values["extraArgs"] == {
        "expander": auto.expander,
        "balance-similar-node-groups": True,
        "scale-down-unneeded-time": auto.scale_down_unneeded_time,
        "scale-down-delay-after-add": auto.scale_down_delay_after_add,
        "max-node-provision-time": auto.max_node_provision_time,
        "skip-nodes-with-local-storage": False,
        "emit-per-nodegroup-metrics": True,
    }
    assert values["serviceMonitor"]["enabled"] is True


@pytest.mark.parametrize("stack", STACKS)
def test_scale_down_waits_for_the_ray_workers_to_drain(stack: str) -> None:
    """cluster-autoscaler waits at most --max-graceful-termination-sec (600 s by default) for a pod
    of a node it removes: the Ray workers' grace period (infra/serving/drain.py) must fit in it."""
    from infra.serving.drain import drain

    extra_args = stack_render(stack).values("cluster-autoscaler")["extraArgs"]
    limit = int(extra_args.get("max-graceful-termination-sec", 600))
    assert drain(stack_config(stack)).grace_seconds <= limit


def test_prod_scale_down_timing_differs_from_the_default() -> None:
    # prod sets 15m: the value must travel, not the model's default.
    assert stack_render("prod").values("cluster-autoscaler")["extraArgs"]["scale-down-unneeded-time"] == "15m"


@pytest.mark.parametrize("stack", STACKS)
def test_load_balancer_controller_knows_cluster_region_and_vpc(stack: str) -> None:
    cfg = stack_config(stack)
    values = stack_render(stack).values("aws-load-balancer-controller")
    assert values["clusterName"] == cfg.cluster.name
    assert values["region"] == cfg.region
    assert values["vpcId"] == "vpc-0123456789abcdef0"
    assert values["ingressClass"] == load_balancer.INGRESS_CLASS


@pytest.mark.parametrize("stack", STACKS)
def test_load_balancer_controller_serves_only_the_serving_namespace_without_waf_or_shield(stack: str) -> None:
    cfg = stack_config(stack)
    values = stack_render(stack).values("aws-load-balancer-controller")
    # A LoadBalancer Service elsewhere in the cluster gets no load balancer from it.
    assert values["watchNamespace"] == cfg.serving.namespace
    # The ALB add-ons its IAM policy no longer grants are off (the chart's defaults are on).
    assert (values["enableWaf"], values["enableWafv2"], values["enableShield"]) == (False, False, False)
    doc = policies.load_balancer_controller("aws", cfg.region, "123456789012", cfg.cluster.name)
    actions = {a for s in doc["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert not {a for a in actions if a.split(":")[0] in ("wafv2", "waf-regional", "waf", "shield")}
    assert "AttachWebAclAndShield" not in {s["Sid"] for s in doc["Statement"]}


def test_without_a_known_vpc_the_controller_is_not_given_one() -> None:
    values = render_platform(stack_config("dev"), vpc_id=None).values("aws-load-balancer-controller")
    assert "vpcId" not in values


@pytest.mark.parametrize("stack", STACKS)
def test_controllers_run_on_system_nodes(stack: str) -> None:
    selector = system_placement(stack_config(stack)).node_selector()
    render = stack_render(stack)
    assert render.values("kuberay-operator")["nodeSelector"] == selector
    assert render.values("keda")["nodeSelector"] == selector
    assert render.values("cluster-autoscaler")["nodeSelector"] == selector
    assert render.values("aws-load-balancer-controller")["nodeSelector"] == selector
    assert render.values("gpu-operator")["operator"]["nodeSelector"] == selector
    prom = render.values("kube-prometheus-stack")
    assert prom["prometheus"]["prometheusSpec"]["nodeSelector"] == selector
    assert prom["alertmanager"]["alertmanagerSpec"]["nodeSelector"] == selector
    assert prom["prometheusOperator"]["nodeSelector"] == selector


def test_a_tainted_system_group_is_tolerated_by_every_controller() -> None:
    def edit(c: dict[str, Any]) -> None:
        c["llm-platform:node_groups"]["system"]["taints"] = [{"key": "dedicated", "value": "system"}]

    cfg = stack_config("dev", edit)
    expected = system_placement(cfg).tolerations()
    assert expected  # the edit took
    render = render_platform(cfg)
    assert render.values("kuberay-operator")["tolerations"] == expected
    assert render.values("keda")["tolerations"] == expected
    assert render.values("cluster-autoscaler")["tolerations"] == expected
    assert render.values("aws-load-balancer-controller")["tolerations"] == expected
    assert render.values("gpu-operator")["operator"]["tolerations"] == expected
    assert render.values("kube-prometheus-stack")["prometheus"]["prometheusSpec"]["tolerations"] == expected


# --- GPU Operator --------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_operator_leaves_the_ami_driver_and_toolkit_alone(stack: str) -> None:
    values = stack_render(stack).values("gpu-operator")
    assert values["driver"]["enabled"] is False
    assert values["toolkit"]["enabled"] is False
    assert values["devicePlugin"]["enabled"] is True
    assert values["nfd"]["enabled"] is True


@pytest.mark.parametrize("stack", STACKS)
def test_dcgm_exporter_is_scraped_with_its_own_labels(stack: str) -> None:
    dcgm = stack_render(stack).values("gpu-operator")["dcgmExporter"]
    assert dcgm["enabled"] is True
    assert dcgm["serviceMonitor"] == {"enabled": True, "interval": "15s", "honorLabels": True}


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_daemonsets_tolerate_exactly_the_gpu_groups_taints(stack: str) -> None:
    cfg = stack_config(stack)
    values = stack_render(stack).values("gpu-operator")
    expected = []
    for placement in gpu_placements(cfg).values():
        expected += [t for t in placement.tolerations() if t not in expected]
    assert values["daemonsets"]["tolerations"] == expected
    assert values["node-feature-discovery"]["worker"]["tolerations"] == expected
    gpu_taint = {"key": GPU_TAINT.key, "operator": "Equal", "value": GPU_TAINT.value, "effect": GPU_TAINT.effect}
    assert gpu_taint in expected


def test_a_gpu_groups_own_taint_is_tolerated_too() -> None:
    def edit(c: dict[str, Any]) -> None:
        c["llm-platform:node_groups"]["gpu"][0]["taints"] = [{"key": "team", "value": "ml", "effect": "NoExecute"}]

    values = render_platform(stack_config("dev", edit)).values("gpu-operator")
    assert {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoExecute"} in values["daemonsets"][
        "tolerations"
    ]


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_mig_strategy_comes_from_config(strategy: str) -> None:
    def edit(c: dict[str, Any]) -> None:
        c["llm-platform:platform"] = {"gpu_operator": {"mig_strategy": strategy}}

    values = render_platform(stack_config("dev", edit)).values("gpu-operator")
    assert values["mig"]["strategy"] == strategy
    assert values["migManager"]["enabled"] is (strategy != "none")


def _bottlerocket(groups: list[int]) -> Any:
    def edit(c: dict[str, Any]) -> None:
        for i in groups:
            c["llm-platform:node_groups"]["gpu"][i]["ami"] = "bottlerocket_nvidia"

    return edit


def test_all_bottlerocket_groups_use_their_own_device_plugin() -> None:
    values = render_platform(stack_config("prod", _bottlerocket([0, 1]))).values("gpu-operator")
    assert values["devicePlugin"]["enabled"] is False
    assert values["driver"]["enabled"] is False


def test_mixed_amis_keep_the_device_plugin_and_bottlerocket_nodes_opt_out() -> None:
    cfg = stack_config("prod", _bottlerocket([1]))
    placements = gpu_placements(cfg)
    assert placements["l40s-4x"].labels[GPU_OPERATOR_DEVICE_PLUGIN_LABEL] == "false"
    assert GPU_OPERATOR_DEVICE_PLUGIN_LABEL not in placements["l40s-1x"].labels
    values = render_platform(cfg).values("gpu-operator")
    assert values["devicePlugin"]["enabled"] is True


# --- monitoring ------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_prometheus_selectors_are_open(stack: str) -> None:
    render = stack_render(stack)
    spec = render.values("kube-prometheus-stack")["prometheus"]["prometheusSpec"]
    for kind in ("rule", "serviceMonitor", "podMonitor", "probe", "scrapeConfig"):
        assert spec[f"{kind}SelectorNilUsesHelmValues"] is False, kind
    assert render.layer["prometheus_selector_labels"] == {}


@pytest.mark.parametrize("stack", STACKS)
def test_prometheus_retention_and_storage_come_from_config(stack: str) -> None:
    cfg = stack_config(stack)
    spec = stack_render(stack).values("kube-prometheus-stack")["prometheus"]["prometheusSpec"]
    assert spec["retention"] == cfg.observability.prometheus_retention
    claim = spec["storageSpec"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == cfg.storage.storage_class.name
    assert claim["resources"]["requests"]["storage"] == f"{cfg.observability.prometheus_storage_gib}Gi"
    size = int(spec["retentionSize"].removesuffix("GB"))
    assert 0 < size < cfg.observability.prometheus_storage_gib


def test_alertmanager_routes_from_the_configured_secret() -> None:
    spec = stack_render("prod").values("kube-prometheus-stack")["alertmanager"]["alertmanagerSpec"]
    assert (
        spec["configSecret"] == stack_config("prod").observability.alertmanager_config_secret == "alertmanager-oncall"
    )
    dev = stack_render("dev").values("kube-prometheus-stack")["alertmanager"]["alertmanagerSpec"]
    assert "configSecret" not in dev


def test_prod_keeps_alertmanager_highly_available() -> None:
    am = stack_render("prod").values("kube-prometheus-stack")["alertmanager"]
    assert am["enabled"] is True
    assert am["alertmanagerSpec"]["replicas"] == 3
    assert stack_render("dev").values("kube-prometheus-stack")["alertmanager"]["alertmanagerSpec"]["replicas"] == 1


@pytest.mark.parametrize("stack", STACKS)
def test_grafana_loads_dashboards_from_its_namespace_and_reads_no_other(stack: str) -> None:
    render = stack_render(stack)
    grafana = render.values("kube-prometheus-stack")["grafana"]
    dashboards = grafana["sidecar"]["dashboards"]
    assert dashboards["enabled"] is True
    # The serving layer's dashboard ConfigMaps live in the monitoring namespace.
    assert dashboards["searchNamespace"] == render.layer["monitoring_namespace"]
    # A Role there, not the chart's ClusterRole over every ConfigMap and Secret.
    assert grafana["rbac"]["namespaced"] is True
    assert (dashboards["label"], dashboards["labelValue"]) == render.layer["dashboard_label"]


@pytest.mark.parametrize("stack", STACKS)
def test_grafana_admin_password_is_a_secret_in_a_secret(stack: str) -> None:
    render = stack_render(stack)
    admin = render.values("kube-prometheus-stack")["grafana"]["admin"]
    secrets = [
        s
        for s in render.of_type("kubernetes:core/v1:Secret")
        if s["inputs"]["metadata"]["name"] == admin["existingSecret"]
    ]
    assert len(secrets) == 1
    secret = secrets[0]["inputs"]
    assert secret["metadata"]["namespace"] == "monitoring"
    # The whole stringData is secret once one value in it is.
    assert secret["stringData"] == SECRET
    assert (admin["userKey"], admin["passwordKey"]) == (
        monitoring.GRAFANA_SECRET_USER_KEY,
        monitoring.GRAFANA_SECRET_PASSWORD_KEY,
    )
    assert secrets[0]["name"] in render.waits_for(render.releases()["kube-prometheus-stack"])


@pytest.mark.parametrize("stack", STACKS)
def test_in_cluster_addresses_follow_the_release_name(stack: str) -> None:
    render = stack_render(stack)
    release = render.releases()["kube-prometheus-stack"]["inputs"]
    name, ns = release["name"], release["namespace"]
    port = release["values"]["prometheus"]["service"]["port"]
    assert render.layer["prometheus_url"] == f"http://{name}-prometheus.{ns}.svc:{port}"
    assert render.layer["grafana_url"] == f"http://{name}-grafana.{ns}.svc:80"
    assert render.layer["monitoring_namespace"] == ns


def test_helm_fullname_follows_the_chart_convention() -> None:
    from infra.cluster_services.chart_release import helm_fullname

    assert helm_fullname("kube-prometheus-stack", "kube-prometheus-stack", limit=26) == "kube-prometheus-stack"
    assert helm_fullname("kube-prometheus-stack", "grafana") == "kube-prometheus-stack-grafana"
    assert helm_fullname("monitoring", "kube-prometheus-stack", limit=26) == "monitoring-kube-prometheus"
    assert helm_fullname("x", "y", override="z") == "z"


# --- storage -----------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_default_storage_class_is_encrypted_gp3(stack: str) -> None:
    cfg = stack_config(stack)
    render = stack_render(stack)
    (sc,) = render.of_type("kubernetes:storage.k8s.io/v1:StorageClass")
    inputs = sc["inputs"]
    assert inputs["metadata"]["name"] == cfg.storage.storage_class.name == render.layer["storage_class"]
    assert inputs["metadata"]["annotations"] == {"storageclass.kubernetes.io/is-default-class": "true"}
    assert inputs["provisioner"] == "ebs.csi.aws.com"
    assert inputs["parameters"] == {"type": "gp3", "encrypted": "true", "iops": "3000", "throughput": "125"}
    assert inputs["volumeBindingMode"] == "WaitForFirstConsumer"
    assert inputs["allowVolumeExpansion"] is True
    assert CLUSTER_READY in render.waits_for(sc)


def test_storage_class_uses_the_configured_kms_key_and_performance() -> None:
    key = "arn:aws:kms:us-west-2:123456789012:key/abcd"

    def edit(c: dict[str, Any]) -> None:
        c["llm-platform:storage"]["storage_class"] = {
            "name": "fast",
            "iops": 6000,
            "throughput_mibps": 500,
            "kms_key_arn": key,
        }

    (sc,) = render_platform(stack_config("dev", edit)).of_type("kubernetes:storage.k8s.io/v1:StorageClass")
    assert sc["inputs"]["metadata"]["name"] == "fast"
    assert sc["inputs"]["parameters"] == {
        "type": "gp3",
        "encrypted": "true",
        "iops": "6000",
        "throughput": "500",
        "kmsKeyId": key,
    }


# --- existing cluster -----------------------------------------------------------------


def test_existing_cluster_with_every_part_on_installs_everything() -> None:
    render = render_platform(stack_config("dev", _existing([])))
    assert set(render.releases()) == ALL_CHARTS


@pytest.mark.parametrize(
    ("part", "chart", "crds"),
    [
        ("gpu_operator", "gpu-operator", None),
        ("kuberay", "kuberay-operator", "ray_crds"),
        ("monitoring", "kube-prometheus-stack", "monitoring_crds"),
        ("keda", "keda", "keda_crds"),
        ("cluster_autoscaler", "cluster-autoscaler", None),
        ("load_balancer_controller", "aws-load-balancer-controller", None),
    ],
)
def test_existing_cluster_part_switched_off_is_not_installed(part: str, chart: str, crds: str | None) -> None:
    render = render_platform(stack_config("dev", _existing([part])))
    assert set(render.releases()) == ALL_CHARTS - {chart}
    if crds is not None:
        assert render.layer[crds] is None
    others = {"ray_crds", "monitoring_crds", "keda_crds"} - {crds}
    assert all(render.layer[o] is not None for o in others)


def test_existing_cluster_without_monitoring_targets_the_clusters_stack() -> None:
    render = render_platform(stack_config("dev", _existing(["monitoring"])))
    assert render.layer["prometheus_selector_labels"] == {"release": "kube-prometheus-stack"}
    assert not render.of_type("random:index/randomPassword:RandomPassword")
    # The other charts' monitors then rely on the cluster's own CRDs.
    assert CLUSTER_READY in render.waits_for(render.releases()["keda"])


def test_existing_cluster_with_everything_off_keeps_only_the_storage_class() -> None:
    parts = ["gpu_operator", "kuberay", "monitoring", "keda", "cluster_autoscaler", "load_balancer_controller"]
    render = render_platform(stack_config("dev", _existing(parts)))
    assert render.releases() == {}
    assert len(render.of_type("kubernetes:storage.k8s.io/v1:StorageClass")) == 1
    assert render.layer["ray_crds"] is None and render.layer["load_balancer_controller"] is None


def test_components_are_typed_and_parented() -> None:
    render = stack_render("dev")
    components = {r["name"]: r["type"] for r in render.resources if r["type"].startswith("llm-platform:platform:")}
    assert set(components.values()) == {
        "llm-platform:platform:StorageClass",
        "llm-platform:platform:Monitoring",
        "llm-platform:platform:LoadBalancerController",
        "llm-platform:platform:GpuOperator",
        "llm-platform:platform:KubeRayOperator",
        "llm-platform:platform:Keda",
        "llm-platform:platform:ClusterAutoscaler",
    }
    for release in render.releases().values():
        assert release["parent"] in components


# --- the parts table ---------------------------------------------------------


def test_parts_are_unique_and_wait_only_for_earlier_parts() -> None:
    from infra.cluster_services.build import PARTS

    names = [p.name for p in PARTS]
    assert len(names) == len(set(names))
    for i, part in enumerate(PARTS):
        assert set(part.after) <= set(names[:i]), f"{part.name} waits for a part declared after it"


def test_a_new_part_is_one_entry_and_waits_for_what_it_names() -> None:
    """A part added to the table is installed with the provider and after the parts it names."""
    from infra.cluster_services.build import PARTS, install_parts
    from infra.cluster_services.chart_release import ChartRelease, ChartReleaseArgs
    from infra.cluster_services.parts import Part, PartContext

    def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
        args = ChartReleaseArgs(
            component_type="llm-platform:platform:Example",
            chart=versions.KEDA,
            version="1.2.3",
            release_name="example",
            namespace="example",
            values={"nodeSelector": ctx.aws.system.node_selector()},
        )
        return ChartRelease(name, args, opts)

    cfg = stack_config("dev")
    parts = (*PARTS, Part("example", lambda ctx: True, build, after=("kuberay-operator",)))

    async def program() -> None:
        install_parts(cfg, fake_aws(cfg), parts)

    render = PlatformRender(resources=run_under_mocks("test", {"aws:region": cfg.region}, [], program), layer={})
    release = next(r for r in render.releases().values() if r["inputs"]["name"] == "example")
    assert release["inputs"]["namespace"] == "example"
    waits = render.waits_for(release)
    assert {"kuberay-operator-release", "example-namespace", CLUSTER_READY} <= waits
    assert "keda-release" not in waits


# --- external-dns ----------------------------------------------------------------------

ZONE = "Z0123456789ABCDEFGHIJ"
EXTERNAL_DNS = ExternalDnsAccess(PodIdentity("external-dns", "external-dns", None), ZONE)


def test_external_dns_runs_only_with_a_domain_and_its_zone() -> None:
    prod, dev = stack_config("prod"), stack_config("dev")
    assert prod.endpoint.domain and not dev.endpoint.domain
    assert "external-dns" in render_platform(prod, external_dns=EXTERNAL_DNS).releases()
    # No zone from the AWS layer (none configured), or no domain: nothing writes records.
    assert "external-dns" not in render_platform(prod).releases()
    assert "external-dns" not in render_platform(dev, external_dns=EXTERNAL_DNS).releases()


def test_external_dns_writes_the_serve_services_names_into_the_one_zone() -> None:
    cfg = stack_config("prod")
    render = render_platform(cfg, external_dns=EXTERNAL_DNS)
    release = render.releases()["external-dns"]
    values = release["inputs"]["values"]
    assert release["inputs"]["namespace"] == EXTERNAL_DNS.identity.namespace
    assert release["inputs"]["name"] == "external-dns"
    assert values["serviceAccount"] == {"create": True, "name": EXTERNAL_DNS.identity.service_account}
    assert values["provider"] == {"name": "aws"}
    assert values["env"] == [{"name": "AWS_DEFAULT_REGION", "value": cfg.region}]
    # The serve Services carry the hostname annotation; nothing else is a source.
    assert values["sources"] == ["service"]
    assert values["domainFilters"] == [cfg.endpoint.domain]
    # Only the serving namespace's load balancers: a Service in another namespace names no record.
    assert values["extraArgs"] == {
        "zone-id-filter": ZONE,
        "namespace": cfg.serving.namespace,
        "service-type-filter": "LoadBalancer",
    }
    assert not values.get("namespaced")  # its Role would need the serving namespace before it exists
    # Records it owns (TXT owner = this cluster) follow their Services; others' are never touched.
    assert (values["policy"], values["registry"], values["txtOwnerId"]) == ("sync", "txt", cfg.cluster.name)
    assert values["nodeSelector"] == system_placement(cfg).node_selector()
    assert values["serviceMonitor"] == {"enabled": True}
    (ns,) = [
        n for n in render.of_type("kubernetes:core/v1:Namespace") if n["inputs"]["metadata"]["name"] == "external-dns"
    ]
    assert ns["inputs"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    waits = render.waits_for(release)
    assert {CLUSTER_READY, "monitoring-release", "load-balancer-controller-release", "external-dns-namespace"} <= waits


def test_the_external_dns_zone_comes_from_the_endpoint() -> None:
    cfg = stack_config("prod")
    # getattr until the config has `endpoint.hosted_zone_id`: a copy carrying it stands in.
    with_zone = cfg.model_copy(update={"endpoint": cfg.endpoint.model_copy(update={"hosted_zone_id": ZONE})})
    assert external_dns_zone(with_zone) == ZONE
    no_domain = with_zone.model_copy(
        update={"endpoint": with_zone.endpoint.model_copy(update={"domain": None, "hosted_zone_id": ZONE})}
    )
    assert external_dns_zone(no_domain) is None
    if getattr(cfg.endpoint, "hosted_zone_id", None) is None:
        assert external_dns_zone(cfg) is None


def test_the_external_dns_policy_changes_only_its_zone() -> None:
    doc = policies.external_dns("aws", ZONE)
    (change,) = [s for s in doc["Statement"] if "route53:ChangeResourceRecordSets" in s["Action"]]
    assert change["Action"] == ["route53:ChangeResourceRecordSets"]
    assert change["Resource"] == [f"arn:aws:route53:::hostedzone/{ZONE}"]
    for stmt in doc["Statement"]:
        if stmt is not change:
            # Read-only calls only, on `*` as upstream grants them.
            assert all(a.startswith("route53:List") for a in stmt["Action"]), stmt
    assert policies.external_dns("aws-cn", ZONE)["Statement"][0]["Resource"] == [
        f"arn:aws-cn:route53:::hostedzone/{ZONE}"
    ]


def test_the_external_dns_role_is_bound_to_its_service_account() -> None:
    from infra.aws.identities import IdentitiesArgs, PodIdentities

    async def program() -> None:
        PodIdentities(
            "pod-identities",
            IdentitiesArgs(
                cluster_name=pulumi.Output.from_input("llm-test"),
                region="us-east-1",
                serving_namespace="llm",
                bucket_arn=pulumi.Output.from_input("arn:aws:s3:::weights"),
                bucket_key_arn=pulumi.Output.from_input("arn:aws:kms:us-east-1:123456789012:key/k"),
                model_prefixes=["org/model"],
                hosted_zone_id=ZONE,
            ),
        )

    resources = run_under_mocks("test", {"aws:region": "us-east-1"}, [], program)
    by_name = {(r["type"], r["name"]): r for r in resources}
    policy = by_name[("aws:iam/rolePolicy:RolePolicy", "pod-identities-external-dns")]["inputs"]["policy"]
    assert json.loads(policy) == policies.external_dns("aws", ZONE)
    association = by_name[("aws:eks/podIdentityAssociation:PodIdentityAssociation", "pod-identities-external-dns")]
    assert (association["inputs"]["namespace"], association["inputs"]["serviceAccount"]) == (
        EXTERNAL_DNS.identity.namespace,
        EXTERNAL_DNS.identity.service_account,
    )
    trust = json.loads(by_name[("aws:iam/role:Role", "pod-identities-external-dns")]["inputs"]["assumeRolePolicy"])
    tags = trust["Statement"][0]["Condition"]["StringEquals"]
    assert tags["aws:RequestTag/kubernetes-service-account"] == "external-dns"
