"""Supply chain and the Ray control plane, held in the render: digests, hashes, caches, auth, Pod Security, RBAC."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra import versions
from infra.aws import front_image, registry
from infra.cluster_services import monitoring
from infra.mocks import ACCOUNT_ID, fake_digest
from infra.serving import autoscaler_scope
from infra.serving.ray_service import RAY_AUTH_MODE, ray_auth_secret_name
from infra.serving.router import FRONT_CONTAINER
from tests.harness import (
    ROUTING,
    SERVE_INGRESS,
    STACKS,
    by_type,
    config_problems,
    manifests_of,
    render_config,
    render_routed,
    render_stack,
    stack_doc,
)

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "workloads"
BY_DIGEST = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
# The routers' front, copied into the stack's own registry (infra/aws/build.py).
FRONT_IMAGE = "router-front-image"

# Charts whose images the program does not name: each runs the images its
# pinned chart version names by tag, and none of these can be given a digest
# here (no registry is reachable to resolve one). The chart version is pinned
# in infra/versions.py and Helm checks the chart archive's digest against
# the repository index. Karpenter's chart names its controller by digest
# itself (chart values `controller.image.digest`).
CHART_IMAGE_EXCEPTIONS = {
    "kube-prometheus-stack": "Prometheus, Alertmanager, Grafana, the operator and exporters by the chart's tags",
    "aws-load-balancer-controller": "the controller from ECR public by the chart's tag",
    "gpu-operator": "NVIDIA's operator, driver, toolkit, device plugin and DCGM by the chart's tags",
    "kuberay-operator": "the operator by the chart's tag (the Ray pods run the serving image by digest)",
    "keda": "operator, metrics server and webhooks by the chart's tags",
    "karpenter": "by digest already: the chart's values carry the controller's digest",
    "cluster-autoscaler": "by CLUSTER_AUTOSCALER_IMAGE_TAG, the minor matching the cluster",
    "external-dns": "the controller by the chart's tag",
}


def _images(obj: Any) -> list[str]:
    """Every container image named in a manifest (any `image` string under a `containers` list)."""
    found: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in {"containers", "initContainers"} and isinstance(value, list):
                found += [c["image"] for c in value if isinstance(c, dict) and "image" in c]
            found += _images(value)
    elif isinstance(obj, list):
        for item in obj:
            found += _images(item)
    return found


@pytest.mark.parametrize("stack", STACKS)
def test_every_image_the_program_builds_or_deploys_is_named_by_digest(stack: str) -> None:
    rendered = render_stack(stack)
    images = [image for m in rendered.manifests for image in _images(m)]
    assert images, "no images in the render"
    for image in images:
        assert BY_DIGEST.match(str(image)), f"{image} is not named by digest"
    # What the image is built from.
    (build,) = [r for r in by_type(rendered, "docker-build:index:Image") if r["name"] == "serving-image"]
    # The base by digest once `make pin-base` has resolved it (it needs Docker Hub); until then the tag.
    assert build["inputs"]["buildArgs"]["BASE_IMAGE"] == versions.RAY_LLM_BASE_IMAGE
    assert not versions.RAY_LLM_BASE_PINNED or BY_DIGEST.match(versions.RAY_LLM_BASE_IMAGE)
    assert BY_DIGEST.match(rendered.outputs["image"])
    # Charts: each is pinned, and each whose images are by tag is written down.
    for release in rendered.helm:
        assert release["name"] in CHART_IMAGE_EXCEPTIONS, f"chart {release['name']}: say how its images are pinned"


def test_a_routed_stack_runs_its_own_copy_of_the_front_by_digest() -> None:
    """The routers' front is the digest the stack's own push returned, copied from versions.ROUTER_FRONT_IMAGE."""
    rendered = render_routed("prod")
    images = {str(image) for m in rendered.manifests for image in _images(m)}
    assert all(BY_DIGEST.match(image) for image in images), images
    (repository,) = [r for r in by_type(rendered, "aws:ecr/repository:Repository") if r["name"] == FRONT_IMAGE]
    assert repository["inputs"]["imageTagMutability"] == "IMMUTABLE"
    assert repository["inputs"]["imageScanningConfiguration"] == {"scanOnPush": True}
    (build,) = [r for r in by_type(rendered, "docker-build:index:Image") if r["name"] == FRONT_IMAGE]
    assert build["inputs"]["buildArgs"] == {"BASE_IMAGE": versions.ROUTER_FRONT_IMAGE}
    assert build["inputs"]["context"]["location"] == str(front_image.CONTEXT)
    assert build["inputs"]["push"] is True and build["inputs"]["buildOnPreview"] is False
    # The repository is named after the serving image's, in the stack's account and region.
    url = f"{ACCOUNT_ID}.dkr.ecr.us-east-1.amazonaws.com/llm-serving-router-front"
    assert repository["inputs"]["name"] == url.rsplit("/", 1)[1]
    assert repository["protect"] and repository["retain_on_delete"]
    (tag,) = build["inputs"]["tags"]
    assert tag == f"{url}:{front_image.front_tag()}"
    copy = f"{url}@{fake_digest(FRONT_IMAGE)}"
    routers = [m for m in manifests_of(rendered, "Deployment") if m["metadata"]["name"].endswith("-router")]
    assert len(routers) == 2
    for router in routers:
        fronts = [c for c in router["spec"]["template"]["spec"]["containers"] if c["name"] == FRONT_CONTAINER]
        assert [c["image"] for c in fronts] == [copy]
    # The source's tag is said once per preview until `make pin-base` resolves it.
    assert rendered.log.count(front_image.UNPINNED_SOURCE_WARNING) == (0 if versions.ROUTER_FRONT_PINNED else 1)
    assert "make pin-base" in front_image.UNPINNED_SOURCE_WARNING


def test_a_front_given_by_digest_is_run_and_nothing_is_copied() -> None:
    given = "registry.example.com/mirror/nginx-unprivileged@sha256:" + "7" * 64
    doc = stack_doc("prod")
    config = doc["config"]
    config["llm-platform:serving"] = {**config["llm-platform:serving"], "routing": ROUTING}
    config["llm-platform:image"] = {"router_front_reference": given}
    rendered = render_config(doc, "prod-front-given")
    made = {r["type"] for r in rendered.resources if r["name"] == FRONT_IMAGE}
    assert made == {"llm-platform:aws:RouterFrontImage"}, made
    routers = [m for m in manifests_of(rendered, "Deployment") if m["metadata"]["name"].endswith("-router")]
    assert routers
    for router in routers:
        containers = router["spec"]["template"]["spec"]["containers"]
        assert [c["image"] for c in containers if c["name"] == FRONT_CONTAINER] == [given]
    assert front_image.UNPINNED_SOURCE_WARNING not in rendered.log


@pytest.mark.parametrize("stack", [SERVE_INGRESS, "prod"])
def test_a_stack_without_routers_copies_no_front(stack: str) -> None:
    assert [r for r in render_stack(stack).resources if r["name"] == FRONT_IMAGE] == []
    assert [r["name"] for r in by_type(render_stack(stack), "docker-build:index:Image")] == ["serving-image"]


def test_a_front_reference_by_tag_is_refused_in_one_line() -> None:
    problems = config_problems("prod", lambda c: c.setdefault("image", {}).update(router_front_reference="nginx:1"))
    assert len(problems) == 1 and "image.router_front_reference: " in problems[0], problems
    assert "sha256" in problems[0] and '"nginx:1"' in problems[0]


def test_the_karpenter_chart_names_its_controller_by_digest() -> None:
    values = (ROOT.parent / "shared" / "reference" / "karpenter" / "chart-values.yaml").resolve()
    if not values.is_file():
        pytest.skip("no upstream reference data on this machine")
    assert re.search(r"^\s+digest: sha256:[0-9a-f]{64}$", values.read_text(), re.MULTILINE)


def test_the_base_image_is_pinned_by_digest_in_versions_and_the_dockerfile() -> None:
    if versions.RAY_LLM_BASE_PINNED:
        assert f"{versions.RAY_LLM_BASE_TAG}@{versions.RAY_LLM_BASE_DIGEST}" == versions.RAY_LLM_BASE_IMAGE
        assert BY_DIGEST.match(versions.RAY_LLM_BASE_IMAGE)
    else:
        # Not resolved yet (no registry here): the tag, and the preview's warning.
        assert versions.RAY_LLM_BASE_IMAGE == versions.RAY_LLM_BASE_TAG
        assert "make pin-base" in (ROOT / "infra" / "aws" / "registry.py").read_text()
    dockerfile = (WORKLOADS / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert default == versions.RAY_LLM_BASE_IMAGE
    assert re.findall(r"^FROM (.+)$", dockerfile, re.MULTILINE) == ["${BASE_IMAGE}"]


def test_the_router_front_is_copied_from_the_pinned_source() -> None:
    """The front's Dockerfile builds FROM what versions.py names, and adds nothing to run."""
    dockerfile = (ROOT / "infra" / "aws" / "router_front" / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert default == versions.ROUTER_FRONT_IMAGE
    assert re.findall(r"^FROM (.+)$", dockerfile, re.MULTILINE) == ["${BASE_IMAGE}"]
    instructions = {line.split()[0] for line in dockerfile.splitlines() if line and line[0].isupper()}
    assert instructions == {"ARG", "FROM", "LABEL"}
    # Alone in its context: anything beside it would move the provider's context hash and start a build.
    assert sorted(p.name for p in front_image.CONTEXT.iterdir()) == ["Dockerfile"]


def _lock_entries(text: str) -> dict[str, tuple[str, list[str]]]:
    entries: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=\S)", "\n".join(line for line in text.splitlines() if not line.startswith("#"))):
        if not block.strip():
            continue
        head = block.split("\\")[0]
        name, version = head.strip().split("==")
        entries[name] = (version, re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return entries


def test_the_image_installs_only_the_hashed_lock() -> None:
    dockerfile = (WORKLOADS / "Dockerfile").read_text()
    # Each `pip install` with its continuation lines.
    installs = re.findall(r"pip install ((?:[^\n\\]|\\\n)*)", dockerfile)
    locked = [i for i in installs if "requirements" in i]
    assert len(locked) == 1 and "requirements.lock" in locked[0]
    for flag in ("--require-hashes", "--no-deps", "--only-binary=:all:"):
        assert flag in locked[0]
    # The package's own build takes the base's setuptools, not an unhashed download.
    assert all("--no-build-isolation" in i for i in installs if "requirements" not in i)
    # Only the lock reaches the build context.
    ignore = (WORKLOADS / ".dockerignore").read_text().split()
    assert "!requirements.lock" in ignore and "!requirements.txt" not in ignore


def test_the_lock_is_made_from_requirements_txt_and_hashes_every_package() -> None:
    text = (WORKLOADS / "requirements.txt").read_text()
    lock = (WORKLOADS / "requirements.lock").read_text()
    assert f"# input sha256: {hashlib.sha256(text.encode()).hexdigest()}" in lock, (
        "workloads/requirements.txt changed: run `make lock-workloads`"
    )
    pins = dict(
        line.split("==") for line in (ln.split("#")[0].strip() for ln in text.splitlines()) if line and "==" in line
    )
    entries = _lock_entries(lock)
    assert {n: v for n, (v, _) in entries.items()} == pins
    for name, (_, hashes) in entries.items():
        assert hashes, f"{name} has no hash in the lock"


def test_the_build_cache_is_immutable_and_keyed_by_what_the_dependencies_are_built_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = render_stack("dev")
    repos = {r["name"]: r["inputs"] for r in by_type(rendered, "aws:ecr/repository:Repository")}
    assert repos["serving-image-cache"]["imageTagMutability"] == "IMMUTABLE"
    (image,) = [r for r in by_type(rendered, "docker-build:index:Image") if r["name"] == "serving-image"]
    cache_to = image["inputs"]["cacheTo"][0]["registry"]
    assert cache_to["ref"].endswith(f":{registry.cache_tag()}") and cache_to["ignoreError"] is True
    assert image["inputs"]["cacheFrom"][0]["registry"]["ref"] == cache_to["ref"]
    # A new lock, Dockerfile or base is a new cache tag; the package's code is not.
    for name in ("Dockerfile", "requirements.lock"):
        shutil.copy(WORKLOADS / name, tmp_path / name)
    (tmp_path / "inference_server").mkdir()
    first = registry.cache_tag(tmp_path)
    (tmp_path / "inference_server" / "app.py").write_text("changed = True\n")
    assert registry.cache_tag(tmp_path) == first
    (tmp_path / "requirements.lock").write_text("humanize==0 \\\n    --hash=sha256:" + "1" * 64 + "\n")
    second = registry.cache_tag(tmp_path)
    assert second != first
    monkeypatch.setattr(registry.versions, "RAY_LLM_BASE_IMAGE", "rayproject/ray-llm:x@sha256:" + "2" * 64)
    assert registry.cache_tag(tmp_path) not in {first, second}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for the diff pin-base prints")
def test_pin_base_rewrites_the_digests_in_versions_and_the_dockerfile(tmp_path: Path) -> None:
    """`make pin-base` with a stand-in `crane` that resolves each tag: one diff, every place."""
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "pin-base.sh", work / "scripts" / "pin-base.sh")
    shutil.copytree(ROOT / "infra", work / "infra", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "workloads").mkdir()
    shutil.copy(WORKLOADS / "Dockerfile", work / "workloads" / "Dockerfile")
    digest = "sha256:" + hashlib.sha256(b"a new base").hexdigest()
    front = "sha256:" + hashlib.sha256(b"a new front").hexdigest()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    crane = bin_dir / "crane"
    crane.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = digest ] && [ "$2" = "{versions.RAY_LLM_BASE_TAG}" ] && echo {digest}\n'
        f'[ "$1" = digest ] && [ "$2" = "{versions.ROUTER_FRONT_TAG}" ] && echo {front}\n'
        "exit 0\n"
    )
    crane.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(ROOT / "venv/bin/python")}
    if not Path(env["PYTHON"]).exists():
        env["PYTHON"] = "python3"
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    done = subprocess.run(
        ["bash", "scripts/pin-base.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    pinned = f"{versions.RAY_LLM_BASE_TAG}@{digest}"
    assert f'RAY_LLM_BASE_DIGEST = "{digest}"' in (work / "infra" / "versions.py").read_text()
    assert f"ARG BASE_IMAGE={pinned}\n" in (work / "workloads" / "Dockerfile").read_text()
    assert f"-> {digest}" in done.stdout
    assert f'ROUTER_FRONT_DIGEST = "{front}"' in (work / "infra" / "versions.py").read_text()
    assert f"{versions.ROUTER_FRONT_TAG} -> {front}" in done.stdout
    front_dockerfile = (work / "infra" / "aws" / "router_front" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={versions.ROUTER_FRONT_TAG}@{front}\n" in front_dockerfile


@pytest.mark.parametrize("stack", STACKS)
def test_every_ray_service_has_token_auth_from_its_own_secret(stack: str) -> None:
    rendered = render_stack(stack)
    secrets = {s["metadata"]["name"]: s for s in manifests_of(rendered, "Secret")}
    services = manifests_of(rendered, "RayService")
    assert services
    for rs in services:
        name = rs["metadata"]["name"]
        cluster = rs["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": RAY_AUTH_MODE, "secretName": ray_auth_secret_name(name)}
        # KubeRay 1.7 refuses token auth below Ray 2.52 (utils/validation.go).
        assert tuple(int(x) for x in cluster["rayVersion"].split(".")) >= (2, 52, 0)
        secret = secrets[ray_auth_secret_name(name)]
        assert secret["metadata"]["namespace"] == rs["metadata"]["namespace"]
        assert secret["stringData"] == "[secret]", "the Ray token reached the render"
        # No pod template names the Secret: KubeRay alone hands it to the Ray containers.
        assert ray_auth_secret_name(name) not in json.dumps(cluster["headGroupSpec"])
        assert ray_auth_secret_name(name) not in json.dumps(cluster["workerGroupSpecs"])
    tokens = by_type(rendered, "random:index/randomPassword:RandomPassword")
    assert {r["name"] for r in tokens} >= {f"{rs['metadata']['name']}-ray-auth-token" for rs in services}


PRIVILEGED = {
    # node-exporter: the host's network and PID namespaces.
    "monitoring",
    # the driver, container toolkit, device plugin and DCGM exporter: host paths and privileged containers.
    "gpu-operator",
}


@pytest.mark.parametrize("stack", STACKS)
def test_every_namespace_has_pod_security_labels(stack: str) -> None:
    namespaces = manifests_of(render_stack(stack), "Namespace")
    assert namespaces
    for ns in namespaces:
        name, labels = ns["metadata"]["name"], ns["metadata"].get("labels", {})
        level = "privileged" if name in PRIVILEGED else "restricted"
        for mode in ("enforce", "audit", "warn"):
            assert labels.get(f"pod-security.kubernetes.io/{mode}") == level, f"{name}: {mode} is not {level}"
        # kube-system and default are the cluster's own: never declared here.
        assert name not in {"kube-system", "default", "kube-public", "kube-node-lease"}


@pytest.mark.parametrize("stack", STACKS)
def test_each_autoscaler_may_change_only_its_own_raycluster(stack: str) -> None:
    rendered = render_stack(stack)
    (service, *_) = manifests_of(rendered, "RayService")
    namespace = service["metadata"]["namespace"]
    (policy,) = manifests_of(rendered, "ValidatingAdmissionPolicy")
    (binding,) = manifests_of(rendered, "ValidatingAdmissionPolicyBinding")
    assert policy["metadata"]["name"] == binding["spec"]["policyName"] == autoscaler_scope.policy_name(namespace)
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": namespace
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in spec["matchConstraints"]["resourceRules"]}
    # What KubeRay's autoscaler Role lets it patch (common/rbac.go BuildRole).
    assert rules == {(("ray.io",), ("rayclusters",)), (("",), ("pods", "pods/resize"))}
    assert all(r["operations"] == ["UPDATE"] for r in spec["matchConstraints"]["resourceRules"])
    expressions = " ".join(v["expression"] for v in spec["validations"])
    assert "request.name" in expressions and "oldObject.metadata.labels['ray.io/cluster']" in expressions
    # The policy exists before any RayService makes a cluster.
    (scope,) = by_type(rendered, "llm-platform:serving:RayAutoscalerScope")
    # (The component, whose dependencies hold back its RayService.)
    for rs in by_type(rendered, "llm-platform:serving:VllmRayService"):
        waits = set(rs["depends_on"])
        assert {f"{scope['name']}-policy", f"{scope['name']}-binding"} <= waits, f"{rs['name']} does not wait for it"


def test_grafana_reads_configmaps_only() -> None:
    rendered = render_stack("dev")
    roles = [r for r in manifests_of(rendered, "Role") if r["metadata"]["namespace"] == monitoring.NAMESPACE]
    (role,) = [r for r in roles if r["metadata"]["name"] == monitoring.grafana_sidecar_role_name()]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]
    (release,) = [h for h in rendered.helm if h["name"] == monitoring.RELEASE_NAME]
    grafana = release["values"]["grafana"]
    # grafana 12.11.1: with useExistingRole the chart renders no Role, and its RoleBinding names this one.
    assert grafana["rbac"] == {"namespaced": True, "useExistingRole": role["metadata"]["name"]}
    assert grafana["sidecar"]["dashboards"]["resource"] == "configmap"
    assert grafana["sidecar"]["datasources"]["resource"] == "configmap"
    assert grafana["sidecar"]["dashboards"]["searchNamespace"] == monitoring.NAMESPACE
