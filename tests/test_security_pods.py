"""Every pod the program declares in the serving namespace passes Pod Security `restricted`.

The namespace enforces `restricted`, so a pod that fails it is refused at
admission: a RayService would then sit with no pods. The checks below are
the Baseline and Restricted controls of the Kubernetes Pod Security
Standards (kubernetes.io/docs/concepts/security/pod-security-standards),
applied to the Deployments' pod templates and to the pods KubeRay builds
from each RayService (tests.harness.ray_service_pods: the templates plus
the autoscaler sidecar and the init container KubeRay adds).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from infra.aws.identities import BATCH_WORKER_SA, MODEL_READER_SA
from infra.render import ROOT
from infra.serving.pod_security import AUTOSCALER_TOKEN_VOLUME, RAY_GID, RAY_UID, SERVICE_ACCOUNT_DIR
from infra.serving.router import ROUTER_OF
from tests.harness import (
    AUTOSCALER_CONTAINER,
    SERVE_INGRESS,
    WAIT_GCS_CONTAINER,
    manifests_of,
    render_routed,
    render_stack,
    stack_config,
    workload_pods,
)

STACKS = ["dev", "prod", SERVE_INGRESS]

# --- the standard's controls ------------------------------------------------------------------

# Baseline, "Capabilities": what may be added at all; Restricted narrows it to one.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}
# Restricted, "Volume Types".
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
# Baseline, "Sysctls": the safe set.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
APPARMOR_ALLOWED = {"RuntimeDefault", "Localhost"}


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("containers", "initContainers", "ephemeralContainers"):
        yield from spec.get(key, [])


def _baseline(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    psc = spec.get("securityContext", {})
    problems = [f"spec.{k} is {spec[k]}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if psc.get("windowsOptions", {}).get("hostProcess"):
        problems.append("spec.securityContext.windowsOptions.hostProcess is set")
    problems += [f"volume {v['name']} is a hostPath" for v in spec.get("volumes", []) if "hostPath" in v]
    problems += [
        f"sysctl {s['name']} is not in the safe set" for s in psc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS
    ]
    if psc.get("seccompProfile", {}).get("type") == "Unconfined":
        problems.append("pod seccompProfile is Unconfined")
    if psc.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in APPARMOR_ALLOWED:
        problems.append("pod appArmorProfile is not RuntimeDefault or Localhost")
    problems += [
        f"annotation {key}={value}"
        for key, value in pod["metadata"].get("annotations", {}).items()
        if key.startswith("container.apparmor.security.beta.kubernetes.io/")
        and value != "runtime/default"
        and not value.startswith("localhost/")
    ]
    problems += _selinux("pod", psc)
    for c in _containers(spec):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            problems.append(f"{name}: hostProcess")
        added = set(sc.get("capabilities", {}).get("add", []))
        problems += [f"{name}: adds capability {cap}" for cap in sorted(added - BASELINE_CAPABILITIES)]
        problems += [f"{name}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{name}: procMount {sc['procMount']}")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            problems.append(f"{name}: seccompProfile Unconfined")
        if sc.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in APPARMOR_ALLOWED:
            problems.append(f"{name}: appArmorProfile")
        problems += _selinux(name, sc)
    return problems


def _selinux(where: str, sc: dict[str, Any]) -> list[str]:
    options = sc.get("seLinuxOptions", {})
    problems = [f"{where}: seLinuxOptions.{k} is set" for k in ("user", "role") if options.get(k)]
    if options.get("type", "") not in SELINUX_TYPES:
        problems.append(f"{where}: seLinuxOptions.type {options['type']}")
    return problems


def _restricted(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    psc = spec.get("securityContext", {})
    problems = [
        f"volume {v['name']} is of a type restricted forbids"
        for v in spec.get("volumes", [])
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES
    ]
    if psc.get("runAsNonRoot") is False:
        problems.append("pod runAsNonRoot is false")
    if psc.get("runAsUser") == 0:
        problems.append("pod runAsUser is 0")
    pod_seccomp = psc.get("seccompProfile", {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_ALLOWED:
        problems.append(f"pod seccompProfile {pod_seccomp}")
    for c in _containers(spec):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot is not true (container or pod)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{name}: runAsUser is 0")
        if sc.get("seccompProfile", {}).get("type", pod_seccomp) not in SECCOMP_ALLOWED:
            problems.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost (container or pod)")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{name}: capabilities.drop lacks ALL")
        problems += [f"{name}: adds {cap}" for cap in sorted(set(caps.get("add", [])) - RESTRICTED_CAPABILITIES)]
    return problems


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What `restricted` (Baseline's controls included) would refuse in a pod."""
    return _baseline(pod) + _restricted(pod)


# --- the checker itself --------------------------------------------------------------------


def _good_pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "annotations": {}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "c",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
            "volumes": [{"name": "v", "emptyDir": {}}],
        },
    }


BREAKS: list[tuple[str, str, Any, str]] = [
    ("spec", "hostNetwork", True, "hostNetwork"),
    ("pod", "runAsNonRoot", False, "runAsNonRoot"),
    ("pod", "runAsUser", 0, "runAsUser is 0"),
    ("pod", "seccompProfile", {"type": "Unconfined"}, "Unconfined"),
    ("container", "allowPrivilegeEscalation", True, "allowPrivilegeEscalation"),
    ("container", "capabilities", {"drop": ["NET_RAW"]}, "drop lacks ALL"),
    ("container", "capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "SYS_ADMIN"),
    ("container", "privileged", True, "privileged"),
    ("volume", "hostPath", {"path": "/"}, "hostPath"),
]


@pytest.mark.parametrize(("where", "key", "value", "expect"), BREAKS, ids=[f"{b[0]}.{b[1]}" for b in BREAKS])
def test_the_checker_catches_each_broken_control(where: str, key: str, value: Any, expect: str) -> None:
    pod = _good_pod()
    assert restricted_violations(pod) == []
    target = {
        "spec": pod["spec"],
        "pod": pod["spec"]["securityContext"],
        "container": pod["spec"]["containers"][0]["securityContext"],
        "volume": pod["spec"]["volumes"][0],
    }[where]
    target[key] = value
    assert any(expect in p for p in restricted_violations(pod)), restricted_violations(pod)


def test_the_checker_needs_seccomp_somewhere_and_non_root_somewhere() -> None:
    pod = _good_pod()
    del pod["spec"]["securityContext"]["seccompProfile"]
    del pod["spec"]["securityContext"]["runAsNonRoot"]
    problems = restricted_violations(pod)
    assert any("seccompProfile" in p for p in problems) and any("runAsNonRoot" in p for p in problems)
    pod["spec"]["containers"][0]["securityContext"] |= {"runAsNonRoot": True, "seccompProfile": {"type": "Localhost"}}
    assert restricted_violations(pod) == []


# --- the program -----------------------------------------------------------------------------


def _serving_pods(stack: str) -> list[dict[str, Any]]:
    namespace = stack_config(stack).serving.namespace
    pods = [p for p in workload_pods(render_stack(stack)) if p["metadata"]["namespace"] == namespace]
    return pods


@pytest.mark.parametrize("stack", STACKS)
def test_serving_namespace_enforces_audits_and_warns_at_restricted(stack: str) -> None:
    cfg = stack_config(stack)
    (ns,) = [
        n for n in manifests_of(render_stack(stack), "Namespace") if n["metadata"]["name"] == cfg.serving.namespace
    ]
    labels = ns["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "latest"


@pytest.mark.parametrize("stack", STACKS)
def test_every_serving_pod_passes_restricted(stack: str) -> None:
    pods = _serving_pods(stack)
    kinds = {p["metadata"]["labels"].get("ray.io/node-type") or p["metadata"]["name"] for p in pods}
    # Ray heads and workers always; headroom placeholders and batch workers where configured.
    assert {"head", "worker"} <= kinds
    cfg = stack_config(stack)
    assert {f"gpu-headroom-{w.name}" for w in cfg.autoscaling.prescale} <= kinds
    if cfg.batch.enabled:
        assert "batch-worker" in kinds
    problems = [f"{p['metadata']['name']}: {v}" for p in pods for v in restricted_violations(p)]
    assert problems == []


@pytest.mark.parametrize("stack", STACKS)
def test_kuberays_added_containers_are_checked_too(stack: str) -> None:
    pods = _serving_pods(stack)
    heads = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
    workers = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]
    assert heads and workers
    for head in heads:
        assert AUTOSCALER_CONTAINER in [c["name"] for c in head["spec"]["containers"]]
    for worker in workers:
        assert WAIT_GCS_CONTAINER in [c["name"] for c in worker["spec"]["initContainers"]]


@pytest.mark.parametrize("stack", STACKS)
def test_pods_run_as_the_images_user(stack: str) -> None:
    """The numeric user must be the image's: runAsNonRoot alone can not check a named user."""
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "workloads" / "Dockerfile").read_text(), re.MULTILINE)
    assert user is not None and (int(user[1]), int(user[2])) == (RAY_UID, RAY_GID)
    for pod in _serving_pods(stack):
        psc = pod["spec"]["securityContext"]
        if "pause" in {c["name"] for c in pod["spec"]["containers"]}:
            assert psc["runAsUser"] == 65535  # the pause image's nobody
            continue
        assert (psc["runAsUser"], psc["runAsGroup"]) == (RAY_UID, RAY_GID), pod["metadata"]["name"]


@pytest.mark.parametrize("stack", STACKS)
def test_no_serving_pod_mounts_a_token_but_the_autoscaler(stack: str) -> None:
    """Code run in a Ray container (the job API runs any) finds no Kubernetes credential.

    A request router keeps its token (its discovery lists pods): it runs no Ray, and
    test_the_request_routers_pods_pass_restricted_and_only_they_add_a_token holds it to that alone.
    """
    for pod in _serving_pods(stack):
        spec = pod["spec"]
        if ROUTER_OF in pod["metadata"]["labels"]:
            assert stack_config(stack).serving.routing.enabled and spec["automountServiceAccountToken"] is True
            continue
        assert spec["automountServiceAccountToken"] is False, pod["metadata"]["name"]
        token_volumes = [v["name"] for v in spec.get("volumes", []) if _has_token(v)]
        holders = [
            c["name"]
            for c in _containers(spec)
            for m in c.get("volumeMounts", [])
            if m["name"] in token_volumes or m["mountPath"].startswith(SERVICE_ACCOUNT_DIR)
        ]
        if pod["metadata"]["labels"].get("ray.io/node-type") == "head":
            assert token_volumes == [AUTOSCALER_TOKEN_VOLUME] and holders == [AUTOSCALER_CONTAINER]
        else:
            assert token_volumes == [] and holders == [], pod["metadata"]["name"]


def _has_token(volume: dict[str, Any]) -> bool:
    return any("serviceAccountToken" in s for s in volume.get("projected", {}).get("sources", []))


@pytest.mark.parametrize("stack", STACKS)
def test_pod_identity_pods_keep_their_accounts(stack: str) -> None:
    """EKS Pod Identity matches the account, not a mounted token: the accounts stay named."""
    pods = {p["metadata"]["name"]: p for p in _serving_pods(stack)}
    gpu = [p for name, p in pods.items() if "-gpu-" in name]
    assert gpu and all(p["spec"]["serviceAccountName"] == MODEL_READER_SA for p in gpu)
    if "batch-worker" in pods:
        assert pods["batch-worker"]["spec"]["serviceAccountName"] == BATCH_WORKER_SA


def test_the_request_routers_pods_pass_restricted_and_only_they_add_a_token() -> None:
    """The router lists and watches pods (router.py), so it keeps the one token outside the heads."""
    namespace = stack_config("prod").serving.namespace
    pods = [p for p in workload_pods(render_routed("prod")) if p["metadata"]["namespace"] == namespace]
    routers = [p for p in pods if p["metadata"]["name"].endswith("-router")]
    assert len(routers) == 2
    problems = [f"{p['metadata']['name']}: {v}" for p in routers for v in restricted_violations(p)]
    assert problems == []
    tokens = sorted(
        p["metadata"]["name"]
        for p in pods
        if p["spec"].get("automountServiceAccountToken") is not False
        and p["metadata"]["labels"].get("ray.io/node-type") != "head"
    )
    assert tokens == sorted(p["metadata"]["name"] for p in routers)
