"""The RayService: shape, placement, autoscaler, upgrades, GCS FT and serveConfigV2."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import versions
from infra.aws.layer import RedisEndpoint
from infra.config import RAY_SERVICE_NAME_MAX
from infra.render import ROOT
from infra.scheduling import gpu_placements, system_placement
from infra.serving import kuberay
from infra.serving.drain import (
    DRAIN_COMMAND_SECONDS,
    POLL_SECONDS,
    PROXY_DRAIN_SECONDS,
    SERVE_PROCESS_PATTERNS,
    STOP_SECONDS,
    WAIT_LOOP_SECONDS,
    drain,
    prestop_script,
)
from infra.serving.ports import RAY_PORTS
from infra.serving.ray_service import (
    INGRESS_GROUP,
    RAY_CLUSTER_LABEL,
    RAY_GROUP_LABEL,
    REDIS_CA_CERT_ENV,
    SERVICE_LABEL,
    SYSTEM_CA_BUNDLE,
    ZONE_LABEL,
    gpu_shape,
    head_env,
    ray_service_manifest,
    worker_group_name,
)
from infra.serving.serve_config import IMPORT_PATH, INGRESS_RESOURCE, MOUNTS, READINESS
from tests.harness import (
    SERVE_INGRESS,
    group,
    manifests_of,
    ray_service_args,
    ray_services,
    reference_dir,
    render_stack,
)
from tests.harness import stack_config as config
from twin.checks import no_local_ray_instance
from workloads.inference_server.catalog import NODE_DRAIN_FILE, NODE_DRAIN_FILE_ENV, WORKER_NICENESS_ENV

# The committed stacks (both vllm-server; dev's model woken by the gateway) and dev on Serve's ingress.
STACKS = ["dev", "prod", SERVE_INGRESS]
# Prod as it would render with every RayService on Serve LLM's OpenAI ingress.
PROD_SERVE_INGRESS = "prod-serve-ingress"


def _prod_serve_ingress_config() -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["llm-platform:serving"] = {**doc["llm-platform:serving"], "layout": "serve-ingress"}

    return config("prod", edit)


def ray_services_of(stack: str) -> list[dict[str, Any]]:
    """The rendered RayServices of a stack, or of prod under serve-ingress (built from hand-made args)."""
    if stack != PROD_SERVE_INGRESS:
        return ray_services(stack)
    cfg = _prod_serve_ingress_config()
    return [ray_service_manifest(ray_service_args(cfg, name)) for name in cfg.services()]


def _layout(rs: dict[str, Any]) -> str:
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    return str(args.get("layout", "serve-ingress"))


def serve_ingress_services(stack: str) -> list[dict[str, Any]]:
    return [rs for rs in ray_services_of(stack) if _layout(rs) == "serve-ingress"]


# Every stack and layout that has an OpenAI ingress to check.
INGRESS_STACKS = [SERVE_INGRESS, PROD_SERVE_INGRESS]


def _container(pod_template: dict[str, Any]) -> dict[str, Any]:
    containers = pod_template["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


@pytest.mark.parametrize("stack", STACKS)
def test_one_ray_service_per_service_with_short_names(stack: str) -> None:
    cfg = config(stack)
    found = {rs["metadata"]["name"]: rs for rs in ray_services(stack)}
    assert set(found) == set(cfg.services())
    for name, rs in found.items():
        assert len(name) <= RAY_SERVICE_NAME_MAX
        assert rs["metadata"]["namespace"] == cfg.serving.namespace


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_groups_ask_for_tp_x_pp_gpus_and_tolerate_exactly_the_group_taints(stack: str) -> None:
    cfg = config(stack)
    placements = gpu_placements(cfg)
    for rs in ray_services(stack):
        for model in cfg.services()[rs["metadata"]["name"]]:
            g = group(rs, worker_group_name(model))
            placement = placements[model.gpu_group]
            limits = _container(g["template"])["resources"]["limits"]
            requests = _container(g["template"])["resources"]["requests"]
            assert int(limits["nvidia.com/gpu"]) * g.get("numOfHosts", 1) == (
                model.tensor_parallel_size * model.pipeline_parallel_size
            )
            assert requests == limits
            spec = g["template"]["spec"]
            assert spec["tolerations"] == placement.tolerations()
            assert {t["key"] for t in spec["tolerations"]} == {t.key for t in placement.taints}
            assert spec["nodeSelector"] == placement.node_selector()
            assert spec["serviceAccountName"] == "model-reader"
            # The accelerator resource rides in the group field KubeRay quotes,
            # never in rayStartParams (see test_ray_start_params_survive_the_shell).
            assert g["resources"] == {f"accelerator_type:{placement.instance.ray_accelerator_type}": "1"}
            assert "resources" not in g["rayStartParams"]
            assert (g["minReplicas"], g["maxReplicas"]) == (
                model.autoscaling.min_replicas,
                model.autoscaling.max_replicas,
            )
            # The pod fits its node with room for daemonsets.
            inst = placement.instance
            share = int(limits["nvidia.com/gpu"]) / inst.gpus
            assert int(limits["cpu"]) < inst.vcpus * share
            assert int(limits["memory"].removesuffix("Gi")) < inst.memory_gib * share
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            # S3 weights stream into memory: no per-pod EBS volume, no model cache at all;
            # the engine caches sit on an emptyDir (the node's NVMe RAID0).
            assert not any("ephemeral" in v for v in spec["volumes"])
            assert "model-cache" not in volumes
            assert "emptyDir" in volumes["engine-cache"] and "medium" not in volumes["engine-cache"]["emptyDir"]


def test_tensor_parallel_70b_takes_the_whole_node() -> None:
    cfg = config("prod")
    model = next(m for m in cfg.models if m.tensor_parallel_size == 4)
    shape = gpu_shape(model, gpu_placements(cfg)[model.gpu_group])
    assert (shape.gpus_per_host, shape.hosts) == (4, 1)


def test_pipeline_stages_beyond_one_node_become_hosts() -> None:
    cfg = config("prod")
    base = next(m for m in cfg.models if m.tensor_parallel_size == 4)
    model = base.model_copy(update={"pipeline_parallel_size": 2})
    shape = gpu_shape(model, gpu_placements(cfg)[model.gpu_group])
    assert (shape.gpus_per_host, shape.hosts) == (4, 2)
    rs = ray_service_manifest(ray_service_args(cfg, base.service_name, models=[model]))
    g = group(rs, worker_group_name(model))
    assert g["numOfHosts"] == 2
    assert _container(g["template"])["resources"]["limits"]["nvidia.com/gpu"] == "4"


@pytest.mark.parametrize("stack", STACKS)
def test_head_holds_no_replicas_and_runs_on_system_nodes(stack: str) -> None:
    cfg = config(stack)
    system = system_placement(cfg)
    for rs in ray_services(stack):
        spec = rs["spec"]
        cluster = spec["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0"
        assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
        assert head["rayStartParams"]["metrics-export-port"] == str(RAY_PORTS.metrics.number)
        assert head["template"]["spec"]["nodeSelector"] == system.node_selector()
        container = _container(head["template"])
        ports = {
            ("gcs-server", 6379),
            ("dashboard", 8265),
            ("client", 10001),
            ("metrics", 8080),
            ("as-metrics", 44217),
            ("dash-metrics", 44227),
        }
        # A vllm-server head names no `serve` port: KubeRay would swap the
        # serve Service's ports for it (see test_kuberay_keeps_the_serve_service_ports).
        if _layout(rs) == "serve-ingress":
            ports.add(("serve", 8000))
        elif rs["metadata"]["name"] in cfg.woken_services() and cfg.serving.gateway.enabled:
            # Serve's proxy on the head, which the gateway's wake request reaches (test_serving_wake.py).
            ports.add(("wake", 8000))
        assert {(p["name"], p["containerPort"]) for p in container["ports"]} == ports
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAY_PROMETHEUS_HOST"].startswith("http://")
        assert env["RAY_GRAFANA_HOST"].startswith("http://")
        assert spec["excludeHeadPodFromServeSvc"] is True
        assert cluster["rayVersion"] == versions.RAY_VERSION
        assert container["image"].partition("@")[2].startswith("sha256:")
        if _layout(rs) == "serve-ingress":
            ingress = group(rs, INGRESS_GROUP)
            assert "nvidia.com/gpu" not in _container(ingress["template"])["resources"]["limits"]
            assert ingress["template"]["spec"]["nodeSelector"] == system.node_selector()


@pytest.mark.parametrize("stack", STACKS)
def test_autoscaler_v2_with_the_configured_idle_timeout(stack: str) -> None:
    cfg = config(stack)
    for rs in ray_services(stack):
        cluster = rs["spec"]["rayClusterConfig"]
        assert cluster["enableInTreeAutoscaling"] is True
        assert cluster["autoscalerOptions"]["version"] == "v2"
        assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == cfg.ray.idle_timeout_seconds


@pytest.mark.parametrize("stack", STACKS)
def test_no_deprecated_kuberay_fields_and_a_ready_wait(stack: str) -> None:
    for rs in ray_services(stack):
        spec = rs["spec"]
        assert "serviceUnhealthySecondThreshold" not in spec
        assert "deploymentUnhealthySecondThreshold" not in spec
        annotations = rs["metadata"]["annotations"]
        # Every condition of the JSON list must hold: Ready, and no upgrade left in progress.
        assert json.loads(annotations["pulumi.com/waitFor"]) == ["condition=Ready", "condition=UpgradeInProgress=False"]
        assert int(annotations["pulumi.com/timeoutSeconds"]) >= 1800


def test_big_models_get_an_hour_to_load() -> None:
    by_name = {rs["metadata"]["name"]: rs for rs in ray_services("prod")}
    assert by_name["llama-33-70b"]["metadata"]["annotations"]["pulumi.com/timeoutSeconds"] == "3600"
    assert by_name["llama-31-8b"]["metadata"]["annotations"]["pulumi.com/timeoutSeconds"] == "1800"


def test_prod_keeps_gcs_state_in_redis_over_tls_with_a_secret_password() -> None:
    for rs in ray_services("prod"):
        ft = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
        assert ft["redisAddress"].startswith("rediss://")
        assert ft["redisPassword"] == {"valueFrom": {"secretKeyRef": {"name": "ray-gcs-redis", "key": "password"}}}
    for rs in ray_services("dev"):
        assert "gcsFaultToleranceOptions" not in rs["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_upgrade_strategy_is_explicit_and_from_config(stack: str) -> None:
    for rs in ray_services(stack):
        assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    cfg = config(stack).model_copy(update={"ray": config(stack).ray.model_copy(update={"upgrade_strategy": "None"})})
    name = cfg.models[0].service_name
    assert ray_service_manifest(ray_service_args(cfg, name))["spec"]["upgradeStrategy"] == {"type": "None"}


@pytest.mark.parametrize("layout", ["vllm-server", "serve-ingress"])
def test_api_keys_are_a_secret_mounted_read_only_only_where_a_guard_runs(layout: str) -> None:
    # The guard runs in each vllm-server replica (GPU groups) or in the OpenAI
    # ingress (ingress group); the head answers no request and gets no key.
    rendered = render_stack("prod")
    secrets = {s["metadata"]["name"]: s for s in manifests_of(rendered, "Secret")}
    keys = secrets["inference-api-keys"]
    assert keys["stringData"] == "[secret]"
    assert "render-placeholder-key" not in json.dumps(rendered.manifests)
    cfg = config("prod")
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"layout": layout})})
    for name in cfg.services():
        rs = ray_service_manifest(ray_service_args(cfg, name))
        cluster = rs["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]["template"]
        assert "api-keys" not in {v["name"] for v in head["spec"]["volumes"]}
        assert "api-keys" not in {m["name"] for m in _container(head).get("volumeMounts", [])}
        guarded = {g["groupName"] for g in cluster["workerGroupSpecs"]}
        if layout == "serve-ingress":
            guarded = {INGRESS_GROUP}
        assert guarded
        for worker in cluster["workerGroupSpecs"]:
            template = worker["template"]
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["name"]: m for m in _container(template)["volumeMounts"]}
            if worker["groupName"] in guarded:
                assert volumes["api-keys"]["secret"]["secretName"] == "inference-api-keys"
                assert mounts["api-keys"] == {"name": "api-keys", "mountPath": MOUNTS.api_keys_dir, "readOnly": True}
            else:
                assert "api-keys" not in volumes and "api-keys" not in mounts, worker["groupName"]
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert args["api_keys_file"] == f"{MOUNTS.api_keys_dir}/{MOUNTS.api_keys_key}"


def test_api_key_file_has_one_key_per_line() -> None:
    from infra.serving.namespace import api_keys_file

    # A key written without an id gets its fingerprint, written out; the batch worker's own key comes last.
    from workloads.inference_server.api_keys import fingerprint

    assert api_keys_file("a" * 24 + ", team:" + "b" * 24) == f"{fingerprint('a' * 24)}:{'a' * 24}\nteam:{'b' * 24}\n"
    assert api_keys_file("team:" + "b" * 24, "c" * 48).splitlines()[-1] == "batch-worker:" + "c" * 48


@pytest.mark.parametrize("stack", STACKS)
def test_serve_config_comes_from_the_catalogue(stack: str) -> None:
    cfg = config(stack)
    for rs in ray_services(stack):
        doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
        (app,) = doc["applications"]
        assert app["import_path"] == IMPORT_PATH
        models = cfg.services()[rs["metadata"]["name"]]
        assert [m["model_id"] for m in app["args"]["models"]] == [m.model_id for m in models]
        for entry, model in zip(app["args"]["models"], models, strict=True):
            assert entry["autoscaling"] == model.autoscaling.model_dump(mode="json")
            assert "gpu_group" not in entry and "name" not in entry
        assert app["args"]["limits"] == cfg.serving.limits.model_dump()


@pytest.mark.parametrize("stack", [*STACKS, PROD_SERVE_INGRESS])
def test_serve_config_is_valid_for_ray_serve_and_serve_llm(stack: str) -> None:
    """Ray's own schema reads the serveConfigV2 of either layout (proxy_location HeadOnly included)."""
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve]==2.60.0 is not installed")
    from workloads.inference_server.catalog import Catalog

    for rs in ray_services_of(stack):
        doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
        schema.ServeDeploySchema.model_validate(doc)
        catalog = Catalog.model_validate(doc["applications"][0]["args"])
        try:
            from ray.serve.llm import LLMConfig

            from workloads.inference_server.engine import llm_config_kwargs
        except ImportError as err:  # pragma: no cover - depends on the environment
            pytest.skip(f"ray.serve.llm or the server package is not importable: {err}")
        for entry in catalog.models:
            config_ = LLMConfig(**llm_config_kwargs(entry, catalog))
            assert config_.accelerator_type == entry.accelerator_type
            deployment = config_.deployment_config
            scaling = deployment["autoscaling_config"]
            assert scaling["target_ongoing_requests"] == entry.autoscaling.target_ongoing_requests
            assert deployment["max_ongoing_requests"] == entry.autoscaling.max_ongoing_requests


def _crd_schema(name: str) -> dict[str, Any]:
    path = reference_dir() / "kuberay" / name
    crd = yaml.safe_load(path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def _unknown_keys(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys a structural schema does not declare (the API server would prune them)."""
    out: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            if key not in schema["properties"]:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    out.append(f"{path}.{key}")
            else:
                out += _unknown_keys(sub, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += _unknown_keys(item, schema["items"], f"{path}[{i}]")
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_ray_services_match_the_pinned_crd(stack: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = _crd_schema("crd-rayservices.yaml")
    for rs in ray_services(stack):
        assert _unknown_keys(rs, schema) == []
        jsonschema.Draft7Validator(schema).validate(rs)


def test_the_label_budgets_policies_and_monitors_select_on_is_one_kuberay_copies_to_pods() -> None:
    """Our template label, never `ray.io/originated-from-*` (on the RayCluster and Services only)."""
    assert kuberay.pods_of("x") == {SERVICE_LABEL: "x"}
    assert not any(key.startswith("ray.io/originated-from") for key in kuberay.pods_of("x"))
    assert kuberay.serve_service_name("x") == "x-serve-svc"
    assert Path(__file__).name.startswith("test_serving_")


# KubeRay refuses a group that sets the group `resources` field together with
# any of these rayStartParams (ray-operator utils/validation.go).
_EXCLUSIVE_WITH_GROUP_RESOURCES = {"num-cpus", "num-gpus", "memory", "resources"}


@pytest.mark.parametrize("stack", STACKS)
def test_ray_start_params_survive_the_shell(stack: str) -> None:
    """KubeRay writes `--key=value` into `bash -c` unquoted: each must stay one word."""
    for rs in ray_services(stack):
        cluster = rs["spec"]["rayClusterConfig"]
        groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
        for name, spec in groups:
            for key, value in spec["rayStartParams"].items():
                word = f"--{key}={value}"
                assert shlex.split(word) == [word], f"{rs['metadata']['name']}/{name}: {word} is split by the shell"
            if "resources" in spec:
                clash = _EXCLUSIVE_WITH_GROUP_RESOURCES & set(spec["rayStartParams"])
                assert not clash, f"{name}: group resources and rayStartParams {sorted(clash)}"


@pytest.mark.parametrize("stack", INGRESS_STACKS)
def test_ingress_keeps_serving_at_every_scale(stack: str) -> None:
    """The OpenAI ingress never follows the models to zero, and its pods all hold a replica."""
    cfg = _prod_serve_ingress_config() if stack == PROD_SERVE_INGRESS else config(stack)
    ingress = cfg.serving.ingress
    services = serve_ingress_services(stack)
    assert services
    for rs in services:
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert args["ingress"]["min_replicas"] >= 1
        assert args["ingress"] == ingress.model_dump(mode="json")
        g = group(rs, INGRESS_GROUP)
        assert g["minReplicas"] == ingress.nodes(ingress.min_replicas) >= 1
        assert g["maxReplicas"] == ingress.nodes(ingress.max_replicas)
        (spread,) = [
            c
            for c in g["template"]["spec"]["topologySpreadConstraints"]
            if c["topologyKey"] == "kubernetes.io/hostname"
        ]
        assert spread["whenUnsatisfiable"] == "DoNotSchedule"
        assert spread["labelSelector"]["matchLabels"] == {
            "llm-platform/ray-service": rs["metadata"]["name"],
            "ray.io/group": INGRESS_GROUP,
        }
        assert g["template"]["metadata"]["labels"]["llm-platform/ray-service"] == rs["metadata"]["name"]


def test_prod_runs_two_ingress_replicas_on_two_nodes() -> None:
    for rs in ray_services_of(PROD_SERVE_INGRESS):
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert args["ingress"]["min_replicas"] >= 2
        assert args["ingress"]["max_replicas_per_node"] == 1
        assert group(rs, INGRESS_GROUP)["minReplicas"] >= 2


@pytest.mark.parametrize("stack", INGRESS_STACKS)
def test_serve_llm_builds_the_ingress_with_the_rendered_bounds(stack: str) -> None:
    """Serve LLM's own builder, on the rendered args: the ingress is never at zero."""
    pytest.importorskip("ray.serve.llm", reason="ray[serve]==2.60.0 is not installed")
    from workloads.inference_server.app import build_app

    for rs in serve_ingress_services(stack):
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        with no_local_ray_instance():
            ingress = build_app(args)._bound_deployment
        scaling = ingress._deployment_config.autoscaling_config
        assert scaling is not None
        assert (scaling.min_replicas, scaling.max_replicas) == (
            args["ingress"]["min_replicas"],
            args["ingress"]["max_replicas"],
        )
        assert ingress._replica_config.max_replicas_per_node == args["ingress"]["max_replicas_per_node"]


@pytest.mark.parametrize("stack", STACKS)
def test_accelerator_type_comes_from_the_gpu_group(stack: str) -> None:
    """Every model names its group's GPU, so its bundle lands on that group and the engine on the GPU."""
    from workloads.inference_server.catalog import Catalog
    from workloads.inference_server.engine import llm_config_kwargs

    cfg = config(stack)
    placements = gpu_placements(cfg)
    for rs in ray_services(stack):
        catalog = Catalog.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"])
        for entry, model in zip(catalog.models, cfg.services()[rs["metadata"]["name"]], strict=True):
            accel = placements[model.gpu_group].instance.ray_accelerator_type
            assert entry.accelerator_type == accel
            kwargs = llm_config_kwargs(entry, catalog)
            assert kwargs["accelerator_type"] == accel
            assert "accelerator_config" not in kwargs


# --- GCS fault tolerance over TLS: the head verifies ElastiCache's certificate ---


def _env(template: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in _container(template).get("env", [])}


@pytest.mark.parametrize("stack", STACKS)
def test_gcs_over_tls_gives_the_head_the_images_ca_bundle(stack: str) -> None:
    """Whenever the GCS keeps its state in a `rediss://` Redis, the rendered head carries RAY_REDIS_CA_CERT."""
    services = ray_services(stack)
    for rs in services:
        cluster = rs["spec"]["rayClusterConfig"]
        ft = cluster.get("gcsFaultToleranceOptions")
        env = _env(cluster["headGroupSpec"]["template"])
        if ft is not None and ft["redisAddress"].startswith("rediss://"):
            assert env[REDIS_CA_CERT_ENV] == SYSTEM_CA_BUNDLE
        else:
            assert REDIS_CA_CERT_ENV not in env
        # Only the head's GCS talks to the Redis.
        for g in cluster["workerGroupSpecs"]:
            assert REDIS_CA_CERT_ENV not in _env(g["template"])
    # Prod has GCS fault tolerance on, so the check above ran on real heads.
    if config(stack).ray.gcs_fault_tolerance.enabled:
        assert all("gcsFaultToleranceOptions" in rs["spec"]["rayClusterConfig"] for rs in services)


@pytest.mark.parametrize("tls", [True, False])
def test_the_ca_bundle_follows_the_redis_scheme(tls: bool) -> None:
    """Dev with a Redis of either scheme: only `rediss://` needs (and gets) the CA bundle."""
    cfg = config("dev")
    # The head's env reads only the scheme; the address and password stay unresolved.
    redis = RedisEndpoint(address=None, password=None, tls=tls)  # type: ignore[arg-type]
    args = ray_service_args(cfg, cfg.models[0].service_name, redis=redis, redis_secret="ray-gcs-redis")
    env = {e["name"]: e["value"] for e in head_env(args)}
    assert (env.get(REDIS_CA_CERT_ENV) == SYSTEM_CA_BUNDLE) is tls
    assert (REDIS_CA_CERT_ENV in env) is tls
    assert {"RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST"} <= set(env)


def test_the_ca_bundle_is_where_the_serving_images_base_keeps_it() -> None:
    """The image builds FROM the Ray LLM image (Ubuntu): the ca-certificates bundle is Debian's path."""
    dockerfile = (ROOT / "workloads" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={versions.RAY_LLM_BASE_IMAGE}" in dockerfile
    assert "FROM ${BASE_IMAGE}" in dockerfile
    assert versions.RAY_LLM_BASE_IMAGE.startswith("rayproject/ray-llm:")
    assert SYSTEM_CA_BUNDLE == "/etc/ssl/certs/ca-certificates.crt"


# --- drain: nothing cuts off a generation the limits allow ---


def _longest_generation(stack: str) -> float:
    cfg = config(stack)
    slo = cfg.observability.slo
    return slo.ttft_p95_seconds + cfg.serving.limits.max_tokens * slo.inter_token_p95_seconds


def _prestop_bound(template: dict[str, Any]) -> int:
    command = _container(template)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    match = re.search(r'\[ "\$SECONDS" -lt (\d+) \]', command[2])
    assert match, command[2]
    bound = int(match.group(1))
    assert f"--deadline-remaining-seconds {bound}" in command[2]
    return bound


@pytest.mark.parametrize("stack", STACKS)
def test_worker_pods_drain_for_the_longest_generation_the_limits_allow(stack: str) -> None:
    longest = _longest_generation(stack)
    timings = drain(config(stack))
    assert timings.serve_timeout_seconds >= longest
    for rs in ray_services(stack):
        spec = rs["spec"]
        # After a NewCluster switch the old cluster finishes its streams before it is deleted.
        assert spec["rayClusterDeletionDelaySeconds"] >= longest + PROXY_DRAIN_SECONDS
        for g in spec["rayClusterConfig"]["workerGroupSpecs"]:
            bound = _prestop_bound(g["template"])
            # Serve stops the node's replicas within its proxy draining period, then
            # each has the whole budget to finish what it holds.
            assert bound >= timings.serve_timeout_seconds + PROXY_DRAIN_SECONDS
            # The grace period covers the hook, then Ray's own stop after SIGTERM.
            assert g["template"]["spec"]["terminationGracePeriodSeconds"] >= bound + STOP_SECONDS
        # The head holds the GCS and the Serve controller: it is not drained.
        assert "lifecycle" not in _container(spec["rayClusterConfig"]["headGroupSpec"]["template"])


@pytest.mark.parametrize("stack", STACKS)
def test_serve_stops_replicas_gracefully_for_the_whole_budget(stack: str) -> None:
    from workloads.inference_server import engine
    from workloads.inference_server.catalog import Catalog

    timings = drain(config(stack))
    wanted = {"graceful_shutdown_timeout_s": timings.serve_timeout_seconds, "graceful_shutdown_wait_loop_s": 2.0}
    assert wanted["graceful_shutdown_wait_loop_s"] == WAIT_LOOP_SECONDS
    for rs in ray_services(stack):
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        catalog = Catalog.model_validate(args)
        if catalog.layout == "vllm-server":
            # One deployment, built by the server's own builder (test_vllm_server_replicas_fill_one_gpu_pod_each).
            continue
        configs = [engine.llm_config_kwargs(e, catalog)["deployment_config"] for e in catalog.models]
        configs.append(engine.ingress_deployment_config(catalog))
        for deployment in configs:
            assert {k: deployment[k] for k in wanted} == wanted
        schema = pytest.importorskip("ray.serve.schema", reason="ray[serve]==2.60.0 is not installed")
        for deployment in configs:
            schema.DeploymentSchema(name="d", **{k: deployment[k] for k in wanted})


def _write_cmdline(proc: Path, pid: int, argv: list[str]) -> Path:
    (proc / str(pid)).mkdir(parents=True)
    path = proc / str(pid) / "cmdline"
    path.write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    return path


def _run_hook(
    seconds: int,
    proc: Path,
    bin_dir: Path,
    node_drain_file: Path | None = None,
    command_seconds: int = DRAIN_COMMAND_SECONDS,
) -> float:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    drain_file = str(node_drain_file) if node_drain_file else None
    script = prestop_script(seconds, str(proc), node_drain_file=drain_file, command_seconds=command_seconds)
    subprocess.run(["bash", "-c", script], env=env, timeout=60, check=True)
    return time.monotonic() - start


NODE_ID = "f" * 56


def _fake_ray_and_python(tmp_path: Path) -> Path:
    """A `ray` that records its drain request and fails it, and a `python` that prints this node's id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/drain-args\nexit 1\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/python-args\necho {NODE_ID}\n')
    for tool in ("ray", "python"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_the_prestop_hook_drains_this_node_by_its_id(tmp_path: Path) -> None:
    """`ray drain-node` without --node-id raises in a process that never connected (Ray's drain_node):
    the hook asks the node's raylet for its id with a driver, then drains that node."""
    bin_dir = _fake_ray_and_python(tmp_path)
    proc = tmp_path / "proc"
    proc.mkdir()
    _run_hook(5, proc, bin_dir)
    assert "ray.init(address='auto'" in (tmp_path / "python-args").read_text()
    args = (tmp_path / "drain-args").read_text().split()
    assert args[:3] == ["drain-node", "--node-id", NODE_ID]


def test_a_vllm_server_pods_hook_drains_its_servers_first(tmp_path: Path) -> None:
    bin_dir = _fake_ray_and_python(tmp_path)
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")  # no Ray to ask: the GCS is gone
    proc = tmp_path / "proc"
    proc.mkdir()
    node_file = tmp_path / "node-draining"
    _run_hook(5, proc, bin_dir, node_file)
    assert node_file.exists()
    assert not (tmp_path / "drain-args").exists()


def test_each_ray_command_of_the_hook_is_bounded_when_no_gcs_answers(tmp_path: Path) -> None:
    """A NewCluster deletion takes the head at once: the node's id and its drain then hang until their bound."""
    bin_dir = _fake_ray_and_python(tmp_path)
    (bin_dir / "python").write_text("#!/bin/sh\nexec sleep 30\n")  # a driver waiting for a GCS that is gone
    proc = tmp_path / "proc"
    proc.mkdir()
    script = prestop_script(1, str(proc), command_seconds=1)
    assert script.count("timeout 1 ") == 2 and prestop_script(1).count(f"timeout {DRAIN_COMMAND_SECONDS} ") == 2
    assert _run_hook(1, proc, bin_dir, command_seconds=1) < 5
    assert not (tmp_path / "drain-args").exists()


@pytest.mark.parametrize("stack", STACKS)
def test_only_vllm_server_pods_name_the_drain_file_in_their_hook(stack: str) -> None:
    for rs in ray_services(stack):
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            (container,) = g["template"]["spec"]["containers"]
            script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            servers = NODE_DRAIN_FILE_ENV in env
            assert servers == (RAY_PORTS.openai.name in {p["name"] for p in container["ports"]})
            assert (f'touch "{NODE_DRAIN_FILE}"' in script) == servers
            if servers:
                assert env[NODE_DRAIN_FILE_ENV] == NODE_DRAIN_FILE


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_workers_start_ray_workers_at_normal_priority_and_the_head_keeps_rays_default(stack: str) -> None:
    """vLLM runs in a Ray worker on a GPU node: not at Ray's nice 15 (catalog.WORKER_NICENESS_ENV)."""
    for rs in ray_services(stack):
        cluster = rs["spec"]["rayClusterConfig"]
        gpu_groups = [
            g
            for g in cluster["workerGroupSpecs"]
            if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
        ]
        assert gpu_groups, rs["metadata"]["name"]
        for g in gpu_groups:
            env = {e["name"]: e.get("value") for e in g["template"]["spec"]["containers"][0].get("env", [])}
            assert {k: env.get(k) for k in WORKER_NICENESS_ENV} == {"RAY_worker_niceness": "0"}
        head_env = {e["name"] for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert not head_env & set(WORKER_NICENESS_ENV)


def test_the_prestop_hook_waits_for_serve_to_leave_the_node_and_no_longer(tmp_path: Path) -> None:
    """Run the hook against a process list of its own, with a `ray` that fails its drain request."""
    bin_dir = _fake_ray_and_python(tmp_path)
    proc = tmp_path / "proc"
    proc.mkdir()
    # Its own shell and its grep are listed too: the hook must not find itself.
    script = prestop_script(60, str(proc))
    _write_cmdline(proc, 10, ["/bin/bash", "-c", script])
    _write_cmdline(proc, 11, ["grep", "-qsa", *SERVE_PROCESS_PATTERNS])
    _write_cmdline(proc, 12, ["ray::IDLE"])
    assert _run_hook(60, proc, bin_dir) < POLL_SECONDS
    assert "--deadline-remaining-seconds 60" in (tmp_path / "drain-args").read_text()

    # A replica that goes after 2 s: the hook waits, then returns at its next look.
    replica = _write_cmdline(proc, 20, ["ray::ServeReplica:llama:LLMServer:llama-3.1-8b"])
    remover = subprocess.Popen(["bash", "-c", f"sleep 2; rm -f {replica}"])
    took = _run_hook(60, proc, bin_dir)
    remover.wait(timeout=10)
    assert 2 <= took < 2 + POLL_SECONDS + 3

    # A proxy that never goes: the hook gives up at its bound.
    _write_cmdline(proc, 30, ["ray::ProxyActor"])
    took = _run_hook(3, proc, bin_dir)
    assert 3 <= took < 3 + POLL_SECONDS + 3


@pytest.mark.parametrize(
    ("title", "serve"),
    [
        ("ray::ServeReplica:app:LLMServer", True),
        ("ray::ProxyActor", True),
        ("ray::ServeController", False),
        ("ray::IDLE", False),
        ("ray::Serve[R]eplica", False),
    ],
)
def test_the_hook_knows_serves_process_titles(title: str, serve: bool) -> None:
    assert any(re.search(p, title) for p in SERVE_PROCESS_PATTERNS) is serve


# --- spread over zones: prod ---


def _zone_spread(template: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in template["spec"].get("topologySpreadConstraints", []) if c["topologyKey"] == ZONE_LABEL]


@pytest.mark.parametrize("stack", ["prod", PROD_SERVE_INGRESS])
def test_prod_spreads_ingress_and_model_replicas_over_zones(stack: str) -> None:
    for rs in ray_services_of(stack):
        name = rs["metadata"]["name"]
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            (spread,) = _zone_spread(g["template"])
            assert spread == {
                "maxSkew": 1,
                "topologyKey": ZONE_LABEL,
                # A preference: a node group spans the zones and cluster-autoscaler can not pick one.
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {SERVICE_LABEL: name, RAY_GROUP_LABEL: g["groupName"]}},
                # Per RayCluster: a NewCluster upgrade's new pods are not weighed against the old ones.
                "matchLabelKeys": [RAY_CLUSTER_LABEL],
            }
            assert g["template"]["metadata"]["labels"][SERVICE_LABEL] == name


def test_dev_is_not_spread_over_zones() -> None:
    for rs in ray_services("dev"):
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            assert _zone_spread(g["template"]) == []


def test_a_multi_host_replica_keeps_its_stages_together() -> None:
    cfg = config("prod")
    base = next(m for m in cfg.models if m.tensor_parallel_size == 4)
    model = base.model_copy(update={"pipeline_parallel_size": 2})
    rs = ray_service_manifest(ray_service_args(cfg, base.service_name, models=[model]))
    g = group(rs, worker_group_name(model))
    assert g["numOfHosts"] == 2
    assert _zone_spread(g["template"]) == []
    assert _zone_spread(group(rs, INGRESS_GROUP)["template"]) != []


# --- the load balancers, as stack outputs ---


@pytest.mark.parametrize("stack", STACKS)
def test_every_model_names_its_load_balancer_beside_its_url(stack: str) -> None:
    """`load_balancers`: the NLB each model's URL resolves to (the name external-dns points at)."""
    from infra.serving.endpoint import PENDING_HOSTNAME

    cfg = config(stack)
    outputs = render_stack(stack).outputs
    assert set(outputs["load_balancers"]) == set(outputs["endpoints"]) == {m.model_id for m in cfg.models}
    for model in cfg.models:
        # Under the mocks the controller never writes the Service's status.
        assert outputs["load_balancers"][model.model_id] == PENDING_HOSTNAME
        if cfg.endpoint.domain:
            assert outputs["endpoints"][model.model_id].startswith(
                f"https://{model.service_name}.{cfg.endpoint.domain}"
            )


@pytest.mark.parametrize("stack", INGRESS_STACKS)
def test_only_the_ingress_group_advertises_what_an_ingress_replica_asks_for(stack: str) -> None:
    """Serve's own builder: an ingress replica needs the resource only ingress nodes have, one per replica slot."""
    pytest.importorskip("ray.serve.llm", reason="ray[serve]==2.60.0 is not installed")
    from workloads.inference_server.app import build_app

    for rs in serve_ingress_services(stack):
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        with no_local_ray_instance():
            need = build_app(args)._bound_deployment._replica_config.resource_dict
        assert need[INGRESS_RESOURCE] == 1
        cluster = rs["spec"]["rayClusterConfig"]
        advertised = {g["groupName"]: g.get("resources", {}) for g in cluster["workerGroupSpecs"]}
        assert advertised.pop(INGRESS_GROUP)[INGRESS_RESOURCE] == str(args["ingress"]["max_replicas_per_node"])
        assert not any(INGRESS_RESOURCE in r for r in advertised.values())
        head = cluster["headGroupSpec"]
        assert INGRESS_RESOURCE not in head.get("resources", {})
        assert INGRESS_RESOURCE not in head["rayStartParams"].get("resources", "")


# --- the vllm-server layout: Serve places the replicas, Kubernetes routes to them ---


def test_the_committed_stacks_serve_in_the_vllm_server_layout_and_serve_ingress_is_asked_for() -> None:
    """`auto`: one model, one pod per replica, never at zero or woken by the gateway -> vllm-server."""
    assert set(config("prod").layouts().values()) == {"vllm-server"}
    assert set(config("dev").layouts().values()) == {"vllm-server"}
    assert set(config(SERVE_INGRESS).layouts().values()) == {"serve-ingress"}
    for rs in [*ray_services("prod"), *ray_services("dev")]:
        doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
        # Nothing routes through Serve's proxies: one on the head, none on the GPU workers.
        assert doc["proxy_location"] == "HeadOnly"
        args = doc["applications"][0]["args"]
        assert args["layout"] == "vllm-server"
        assert args["vllm_server"] == {
            "host": "0.0.0.0",
            "port": RAY_PORTS.openai.number,
            "metrics_port": RAY_PORTS.vllm_metrics.number,
            "address_dir": None,
            "drain_notice_s": READINESS.drain_notice_s,
        }
        # No OpenAI ingress, so no ingress group, resource or settings.
        assert "ingress" not in args and "ingress_resource" not in args
        groups = [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
        assert INGRESS_GROUP not in groups and all(g.startswith("gpu-") for g in groups)
    for rs in ray_services(SERVE_INGRESS):
        doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
        assert doc["proxy_location"] == "EveryNode"
        # Written as before layouts existed: the server's default is serve-ingress.
        assert "layout" not in doc["applications"][0]["args"]
        assert "vllm_server" not in doc["applications"][0]["args"]


def _declared(template: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container(template).get("ports", [])}


@pytest.mark.parametrize("stack", STACKS)
def test_vllm_server_gpu_workers_declare_their_server_and_are_ready_when_it_is_healthy(stack: str) -> None:
    for rs in ray_services(stack):
        vllm_server = _layout(rs) == "vllm-server"
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            if not g["groupName"].startswith("gpu-"):
                continue
            ports = _declared(g["template"])
            container = _container(g["template"])
            skips = g["template"]["metadata"]["annotations"].values()
            if not vllm_server:
                assert "openai" not in ports and "readinessProbe" not in container
                continue
            assert ports[RAY_PORTS.openai.name] == 8100 and ports[RAY_PORTS.vllm_metrics.name] == 8101
            # No Serve proxy runs on a GPU worker here (proxy_location HeadOnly): no `serve` port to open.
            assert RAY_PORTS.metrics.name in ports and RAY_PORTS.serve.name not in ports
            probe = container["readinessProbe"]
            # KubeRay keeps a probe it is given; this one asks the replica's own server (no API key on /health).
            assert probe["httpGet"] == {"path": "/health", "port": RAY_PORTS.openai.name, "scheme": "HTTP"}
            assert probe["httpGet"]["port"] in ports
            assert probe["periodSeconds"] <= 10 and probe["timeoutSeconds"] <= probe["periodSeconds"]
            # A draining replica keeps serving past the probe's misses, and the load balancer's deregistration after.
            notice = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["vllm_server"]
            assert notice["drain_notice_s"] >= probe["periodSeconds"] * probe["failureThreshold"] + 30
            assert not any(v.startswith("CKV_K8S_9=") for v in skips)
            assert "livenessProbe" not in container  # KubeRay's own (dashboard agent) stays


def _kuberay_serve_service_ports(rs: dict[str, Any]) -> list[dict[str, Any]]:
    """The ports KubeRay 1.7 gives the serve Service of a RayService with a custom `serveService`.

    ray-operator/controllers/ray/common/service.go BuildServeService: the head
    container's ports named `serve` or `serve-*`, each replaced by the user's
    port of the same name; the user's ports unchanged only when the head has none.
    """
    head = _container(rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    auto = [p for p in head.get("ports", []) if p["name"] == "serve" or p["name"].startswith("serve-")]
    user = rs["spec"]["serveService"]["spec"]["ports"]
    if not auto:
        return list(user)
    by_name = {p["name"]: p for p in user}
    return [by_name.get(p["name"], {"name": p["name"], "port": p["containerPort"]}) for p in auto]


@pytest.mark.parametrize("stack", [*STACKS, PROD_SERVE_INGRESS])
def test_kuberay_keeps_the_serve_service_ports_and_they_reach_the_serving_pods(stack: str) -> None:
    """The load balancer listens where the program says and targets a port only the serving pods declare."""
    for rs in ray_services_of(stack):
        svc = rs["spec"]["serveService"]
        assert _kuberay_serve_service_ports(rs) == svc["spec"]["ports"]
        (port,) = svc["spec"]["ports"]
        wanted = RAY_PORTS.openai if _layout(rs) == "vllm-server" else RAY_PORTS.serve
        assert port["targetPort"] == wanted.name
        serving = [
            g
            for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
            if port["targetPort"] in _declared(g["template"])
        ]
        assert serving, "no worker declares the port the serve Service targets"
        if _layout(rs) == "vllm-server":
            # Only the GPU workers, each a replica's server.
            assert {g["groupName"] for g in serving} == {
                worker_group_name(m) for m in config("prod").services()[rs["metadata"]["name"]]
            }
        assert rs["spec"]["excludeHeadPodFromServeSvc"] is True


@pytest.mark.parametrize("stack", STACKS)
def test_vllm_server_replicas_fill_one_gpu_pod_each(stack: str) -> None:
    """The server's own builder: a replica asks for its group's GPUs and accelerator, and stops gracefully."""
    pytest.importorskip("ray.serve", reason="ray[serve]==2.60.0 is not installed")
    from workloads.inference_server.app import build_app

    timings = drain(config(stack))
    checked = 0
    for rs in ray_services(stack):
        if _layout(rs) != "vllm-server":
            continue
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        with no_local_ray_instance():
            deployment = build_app(args)._bound_deployment
        need = deployment._replica_config.resource_dict
        (g,) = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"].startswith("gpu-")]
        limits = _container(g["template"])["resources"]["limits"]
        assert need["GPU"] == int(limits["nvidia.com/gpu"]) * g.get("numOfHosts", 1)
        assert need["CPU"] <= int(limits["cpu"])
        (accelerator,) = g["resources"]
        assert need[accelerator] > 0
        config_ = deployment._deployment_config
        assert config_.graceful_shutdown_timeout_s == timings.serve_timeout_seconds
        # At least one, or zero for a model the gateway wakes.
        floor = 0 if rs["metadata"]["name"] in config(stack).woken_services() else 1
        assert config_.autoscaling_config.min_replicas == args["models"][0]["autoscaling"]["min_replicas"] >= floor
        checked += 1
    assert checked == {"prod": 2, "dev": 1, SERVE_INGRESS: 0}[stack]


def test_vllm_server_replicas_get_the_engine_start_timeout() -> None:
    from infra.serving.ray_service import VLLM_SERVER_START_TIMEOUT_ENV

    for stack in ("prod", "dev"):
        cfg = config(stack)
        for rs in ray_services(stack):
            for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
                start = str(cfg.ray.cold_start.engine_start_seconds)
                assert _env(g["template"])[VLLM_SERVER_START_TIMEOUT_ENV] == start
    for rs in ray_services(SERVE_INGRESS):
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            assert VLLM_SERVER_START_TIMEOUT_ENV not in _env(g["template"])
    # The replica reads that name (workloads/inference_server/vllm_server.py).
    assert VLLM_SERVER_START_TIMEOUT_ENV in (ROOT / "workloads/inference_server/vllm_server.py").read_text()
