"""Shared helpers: render a stack under mocks once per session and look things up."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random
import pytest
import yaml

from infra.aws.layer import AwsLayer, KarpenterAccess, PodIdentity
from infra.capacity.plan import EngineSettings
from infra.config import ConfigError, StackConfig, load_stack_file, parse, read_stack_file, sections
from infra.render import ROOT, SECRET, Rendered, render, render_document, run_under_mocks, stack_document
from infra.scheduling import gpu_placements, system_placement
from infra.serving.endpoint import serve_service_spec
from infra.serving.ray_service import VllmRayServiceArgs
from twin import kuberay as mirror

if TYPE_CHECKING:
    from twin.routing import RouterSpec

STACKS = sorted(p.name.split(".")[1] for p in ROOT.glob("Pulumi.*.yaml"))
# The pinned charts' values and CRDs the tests check the program against,
# kept outside the project; scripts/fetch-reference.sh fetches them.
REFERENCE_VARIABLE = "LLM_PLATFORM_REFERENCE"
REFERENCE = Path(os.environ.get(REFERENCE_VARIABLE) or ROOT.parent / "shared" / "reference")


def reference_dir() -> Path:
    """The reference folder, for a test that reads it.

    Without it the test skips, saying why; under CI (`CI=true`) it fails, so a
    runner that lacks the data never goes green by skipping.
    """
    if not REFERENCE.is_dir():
        message = (
            f"no reference data at {REFERENCE}: fetch it with scripts/fetch-reference.sh, "
            f"or set {REFERENCE_VARIABLE} to the folder that holds it"
        )
        if os.environ.get("CI", "").lower() in {"true", "1"}:
            pytest.fail(f"CI=true and {message}", pytrace=False)
        pytest.skip(message)
    return REFERENCE


UPSTREAM_VARIABLE = "LLM_PLATFORM_UPSTREAM"
UPSTREAM = Path(os.environ.get(UPSTREAM_VARIABLE) or ROOT / "build" / "upstream")


def upstream_dir() -> Path:
    """Where `scripts/fetch-reference.sh --upstream` puts the cited upstream files the reference folder lacks.

    The shared reference folder is read-only and holds no copy of them, and CI
    has no network to fetch them: a test that needs them skips without them,
    even under CI, naming the command that fetches them.
    """
    if not UPSTREAM.is_dir():
        pytest.skip(
            f"no upstream files at {UPSTREAM}: fetch them with scripts/fetch-reference.sh --upstream, "
            f"or set {UPSTREAM_VARIABLE} to the folder that holds them"
        )
    return UPSTREAM


# Dev's stack file on Serve's OpenAI ingress (`serving.layout: serve-ingress`, routing and the gateway
# off: they send to vllm-server replicas only): the committed stacks' example of that layout, its
# model still scaling to zero. The tests and the twin's monitored session use it under this name.
SERVE_INGRESS = "dev-serve-ingress"


def serve_ingress_doc() -> dict[str, Any]:
    """Dev's stack file with its model on Serve's OpenAI ingress (SERVE_INGRESS)."""
    doc = copy.deepcopy(stack_document("dev"))
    serving = {**doc["config"]["llm-platform:serving"], "layout": "serve-ingress"}
    for section in ("routing", "gateway"):
        serving.pop(section, None)
    doc["config"]["llm-platform:serving"] = serving
    return doc


# Stacks the tests render beside the committed ones: name -> (the stack it renders as, its document).
VARIANTS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {SERVE_INGRESS: ("dev", serve_ingress_doc)}


@cache
def render_stack(stack: str) -> Rendered:
    """The render of a committed stack or of a VARIANTS one (cached: treat it as read-only)."""
    if stack in VARIANTS:
        name, doc = VARIANTS[stack]
        return render_document(name, doc())
    return render(stack)


def render_config(doc: dict[str, Any], stack: str = "custom") -> Rendered:
    """Render a stack file given as a dict (the `config:` document)."""
    return render_document(stack, doc)


# What tests/test_selectors.py, test_serving_router.py and test_security_pods.py turn on.
ROUTING = {"enabled": True, "min_replicas": 2, "policy": "cache_aware", "cache_threshold": 0.5}
# And the model gateway in front of those routers (prod: both models at one address;
# dev: its one model, which scales to zero and which the gateway then wakes).
GATEWAY = {"enabled": True, "min_replicas": 2}


@cache
def render_routed(stack: str) -> Rendered:
    """A committed stack with its request router and model gateway on (`serving.routing` = ROUTING,
    `serving.gateway` = GATEWAY): prod's two models at one address, dev's model woken from zero."""
    doc = copy.deepcopy(stack_doc(stack))
    config = doc["config"]
    serving = {**config.get("llm-platform:serving", {}), "routing": ROUTING, "gateway": GATEWAY}
    config["llm-platform:serving"] = serving
    return render_config(doc, f"{stack}-routed")


def stack_doc(stack: str) -> dict[str, Any]:
    """A committed (or VARIANTS) stack file as a dict, to copy and break in tests."""
    if stack in VARIANTS:
        return VARIANTS[stack][1]()
    return stack_document(stack)


def prod_router_spec(directory: Path, routing: dict[str, Any]) -> RouterSpec:
    """The router the render gives prod's first vllm-server service with `serving.routing` = ``routing``,
    read from a copy of prod's stack file written in ``directory``."""
    from twin.routing import router_specs

    doc = copy.deepcopy(stack_doc("prod"))
    doc["config"]["llm-platform:serving"] = {**doc["config"].get("llm-platform:serving", {}), "routing": routing}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "Pulumi.prod.yaml"
    path.write_text(yaml.safe_dump(doc))
    return next(iter(router_specs(path).values()))


def by_type(rendered: Rendered, type_token: str) -> list[dict[str, Any]]:
    """Resources of one Pulumi type."""
    return [r for r in rendered.resources if r["type"] == type_token]


def manifests_of(rendered: Rendered, kind: str) -> list[dict[str, Any]]:
    """Kubernetes objects of one kind."""
    return [m for m in rendered.manifests if m.get("kind") == kind]


def release(rendered: Rendered, chart: str) -> dict[str, Any]:
    """The Helm release of one chart."""
    found = [h for h in rendered.helm if h["chart"] == chart]
    assert len(found) == 1, f"expected one release of {chart}, found {len(found)}"
    return found[0]


def waits_for(resources: list[dict[str, Any]], resource: dict[str, Any]) -> set[str]:
    """Names a resource waits for: its own dependencies and its ancestors'.

    A component's `depends_on` holds back its children: Pulumi registers a
    child only after its parent, and the parent after its dependencies.
    """
    by_name = {r["name"]: r for r in resources}
    found: set[str] = set()
    node: dict[str, Any] | None = resource
    while node is not None:
        found |= set(node["depends_on"])
        node = by_name.get(node["parent"]) if node["parent"] else None
    return found


# --- configs from the stack files ----------------------------------------------

ConfigEdit = Callable[[dict[str, Any]], None]


def stack_sections(stack: str, edit: ConfigEdit | None = None) -> dict[str, Any]:
    """A committed stack file's sections, as the program reads them, optionally edited first.

    `edit` changes the file's `config:` mapping (keys like `llm-platform:models`).
    """
    doc = copy.deepcopy(stack_doc(stack))
    if edit is not None:
        edit(doc["config"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"Pulumi.{stack}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return sections(read_stack_file(path)[0])


def config_problems(stack: str, change: Callable[[dict[str, Any]], None]) -> list[str]:
    """The one-line problems the config reports for a stack's sections after `change`; [] if it accepts them."""
    raw = stack_sections(stack)
    change(raw)
    try:
        parse(raw)
    except ConfigError as err:
        return [str(p) for p in err.problems]
    return []


def doc_config(doc: dict[str, Any]) -> StackConfig:
    """A stack file given as a document (`{"config": ...}`), validated as the program would."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "Pulumi.doc.yaml"
        path.write_text(yaml.safe_dump(doc))
        return load_stack_file(path)


def stack_config(stack: str, edit: ConfigEdit | None = None, **overrides: Any) -> StackConfig:
    """A committed stack's validated config; `edit` changes the file, `overrides` replace whole sections."""
    if edit is None and not overrides and stack not in VARIANTS:
        return load_stack_file(ROOT / f"Pulumi.{stack}.yaml")
    raw = stack_sections(stack, edit)
    raw.update(overrides)
    return parse(raw)


# --- the serving layer's inputs and outputs ------------------------------------------

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving@sha256:" + "a" * 64


def ray_service_args(cfg: StackConfig, service: str, **overrides: Any) -> VllmRayServiceArgs:
    """Hand-made arguments for one RayService of `cfg`, as build_serving would give them."""
    values: dict[str, Any] = {
        "cfg": cfg,
        "name": service,
        "models": cfg.services()[service],
        "namespace": cfg.serving.namespace,
        "image": IMAGE,
        "system": system_placement(cfg),
        "gpu": gpu_placements(cfg),
        "model_reader_service_account": "model-reader",
        "api_keys_secret": "inference-api-keys",
        "storage_class": "gp3-encrypted",
        "prometheus_url": "http://prometheus.monitoring.svc:9090",
        "grafana_url": "http://grafana.monitoring.svc:80",
        "serving_priority_class": "llm-serving",
        "serve_service": serve_service_spec(service, cfg.serving.namespace, cfg.layout_of(service)),
    }
    values.update(overrides)
    return VllmRayServiceArgs(**values)


def ray_services(stack: str) -> list[dict[str, Any]]:
    """The RayServices of a rendered stack."""
    return manifests_of(render_stack(stack), "RayService")


def group(ray_service: dict[str, Any], name: str) -> dict[str, Any]:
    """One worker group of a RayService."""
    groups = ray_service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    found = [g for g in groups if g["groupName"] == name]
    assert len(found) == 1, f"{name} not in {[g['groupName'] for g in groups]}"
    only: dict[str, Any] = found[0]
    return only


# --- the platform layer on its own ----------------------------------------------------

CLUSTER_READY = "cluster-ready"
CA_IDENTITY = PodIdentity("kube-system", "cluster-autoscaler", None)
LBC_IDENTITY = PodIdentity("kube-system", "aws-load-balancer-controller", None)
KEDA_IDENTITY = PodIdentity("keda", "keda-operator", None)
# Karpenter's access as the AWS layer hands it down (plain values instead of outputs).
KARPENTER_ACCESS = KarpenterAccess(
    identity=PodIdentity("kube-system", "karpenter", None),
    interruption_queue="llm-test-karpenter",
    node_role_name="karpenter-node",
    subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
    security_group_ids=["sg-0123456789abcdef0"],
)
CRD_GROUPS = {
    "ray.io": "kuberay-operator",
    "monitoring.coreos.com": "kube-prometheus-stack",
    "keda.sh": "keda",
}


@dataclass
class PlatformRender:
    """What building the platform layer declared."""

    resources: list[dict[str, Any]]
    layer: dict[str, Any]

    def releases(self) -> dict[str, dict[str, Any]]:
        """Helm releases by chart name (an OCI chart's last path segment)."""
        return {
            r["inputs"]["chart"].rsplit("/", 1)[-1]: r
            for r in self.resources
            if r["type"] == "kubernetes:helm.sh/v3:Release"
        }

    def values(self, chart: str) -> dict[str, Any]:
        """The values one release sets."""
        values: dict[str, Any] = self.releases()[chart]["inputs"].get("values", {})
        return values

    def waits_for(self, resource: dict[str, Any]) -> set[str]:
        """What a resource waits for: its own dependencies and its ancestors'."""
        return waits_for(self.resources, resource)

    def of_type(self, token: str) -> list[dict[str, Any]]:
        """Resources of one type."""
        return [r for r in self.resources if r["type"] == token]


def fake_aws(cfg: StackConfig, **changes: Any) -> AwsLayer:
    """The AwsLayer the AWS layer would hand down, made by hand."""
    provider = k8s.Provider("k8s", kubeconfig="{}")
    ready = random.RandomId(CLUSTER_READY, byte_length=4)
    aws = AwsLayer(
        provider=provider,
        cluster_name=pulumi.Output.from_input(cfg.cluster.name),
        kubeconfig=None,
        system=system_placement(cfg),
        gpu=gpu_placements(cfg),
        node_group_names={},
        model_bucket=pulumi.Output.from_input(cfg.storage.model_bucket),
        image=pulumi.Output.from_input("registry/image@sha256:" + "0" * 64),
        model_reader=PodIdentity(cfg.serving.namespace, "model-reader", None),
        cluster_autoscaler=CA_IDENTITY,
        load_balancer_controller=LBC_IDENTITY,
        redis=None,
        vpc_id=pulumi.Output.from_input("vpc-0123456789abcdef0"),
        keda_operator=KEDA_IDENTITY,
        cluster_ready=[ready],
    )
    return replace(aws, **changes)


def _name(urn: str) -> str:
    return urn.split("::")[-1]


def render_platform(cfg: StackConfig, **aws_changes: Any) -> PlatformRender:
    """Run build_platform under the project's mocks and record what it declared."""
    from infra.cluster_services.build import build_platform

    layer: dict[str, Any] = {}

    async def program() -> None:
        result = build_platform(cfg, fake_aws(cfg, **aws_changes))
        for name, value in vars(result).items():
            if isinstance(value, pulumi.Resource):
                layer[name] = _name(await value.urn.future())
            elif isinstance(value, pulumi.Output):
                layer[name] = SECRET if await value.is_secret() else await value.future()
            else:
                layer[name] = value

    resources = run_under_mocks("test", {"aws:region": cfg.region}, [], program)
    return PlatformRender(resources=resources, layer=layer)


_CACHE: dict[str, PlatformRender] = {}


def stack_render(stack: str) -> PlatformRender:
    """The platform layer of a committed stack (cached, read-only)."""
    if stack not in _CACHE:
        _CACHE[stack] = render_platform(stack_config(stack))
    return _CACHE[stack]


def render_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m infra.render ARGS` as a user runs it, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "infra.render", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# --- the pods the program declares ---------------------------------------------------

# Ray pods are built by the KubeRay mirror (twin/kuberay.py), never by hand: what
# KubeRay v1.7.0 really puts on them (labels, the autoscaler sidecar, the
# wait-gcs-ready init container, probes, env) is what these tests see.
AUTOSCALER_CONTAINER = mirror.AUTOSCALER_CONTAINER
WAIT_GCS_CONTAINER = mirror.WAIT_GCS_CONTAINER
# The five characters KubeRay appends to a RayService's name for each cluster.
CLUSTER_SUFFIX = "abcde"


def _pod(rs: dict[str, Any], template: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    meta = template.get("metadata", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": rs["metadata"]["namespace"],
            "labels": {**meta.get("labels", {}), **labels},
            "annotations": dict(meta.get("annotations", {})),
        },
        "spec": copy.deepcopy(template["spec"]),
    }


def ray_cluster(rs: dict[str, Any], suffix: str = CLUSTER_SUFFIX) -> mirror.RayClusterRef:
    """One RayCluster of a rendered RayService, as KubeRay names it."""
    return mirror.RayClusterRef(mirror.ray_cluster_name(rs, suffix), rs)


def ray_service_pods(rs: dict[str, Any], suffix: str = CLUSTER_SUFFIX) -> list[dict[str, Any]]:
    """The head and one pod of each worker group (a group at zero too), as KubeRay builds them."""
    cluster = ray_cluster(rs, suffix)
    groups = rs["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
    return mirror.build_cluster_pods(cluster, {str(g["groupName"]): 1 for g in groups})


def workload_pods(rendered: Rendered) -> list[dict[str, Any]]:
    """Every pod a rendered stack declares outside Helm charts: Deployments' and RayServices'."""
    pods: list[dict[str, Any]] = []
    for dep in manifests_of(rendered, "Deployment"):
        template = dep["spec"]["template"]
        pod = _pod(dep, template, dep["metadata"]["name"], {})
        pods.append(pod)
    for rs in manifests_of(rendered, "RayService"):
        pods += ray_service_pods(rs)
    return pods


def engine(**changes: object) -> EngineSettings:
    """One replica's engine settings for the capacity tests: 8B-style defaults, ``changes`` over them."""
    base = EngineSettings(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        max_model_len=8192,
        dtype="bfloat16",
        quantization=None,
        gpu_memory_utilization=0.9,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def workloads_env() -> dict[str, str]:
    """This environment, with the serving image's package (`inference_server`) and the repository importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "workloads"), str(ROOT)])}


def start_importing_server(model_dir: Path, stderr: Any, timeout_s: float = 30) -> subprocess.Popen[bytes]:
    """`python -m inference_server.vllm_main` for a model it will never load, its own session leader, returned
    once it handles ``vllm_main.STACKS_SIGNAL`` and carries its title: it is then importing vLLM (where a hung
    start sat for minutes; seconds here). Sent earlier, the signal's default action would end it."""
    import json
    import time

    from workloads.inference_server.vllm_main import API_SERVER_TITLE, PARENT_ENV, SPEC_ENV, STACKS_SIGNAL

    spec = {"model": str(model_dir), "served_model_name": "m", "host": "127.0.0.1", "port": 1, "engine_kwargs": {}}
    env = {**workloads_env(), SPEC_ENV: json.dumps(spec), PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_server.vllm_main"], env=env, stderr=stderr, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            title = Path(f"/proc/{proc.pid}/comm").read_text().strip()
        except OSError:
            break
        caught = int(next(x.split()[1] for x in status.splitlines() if x.startswith("SigCgt:")), 16)
        if caught >> (STACKS_SIGNAL - 1) & 1 and API_SERVER_TITLE.startswith(title):
            return proc
        time.sleep(0.01)
    os.killpg(proc.pid, 9)
    proc.wait()
    raise AssertionError(f"the server ended or did not handle its stacks signal within {timeout_s:.0f}s")
