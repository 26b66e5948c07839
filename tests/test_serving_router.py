"""The request router (serving.routing) as rendered: what vllm-router is told, what it may do, who reaches it.

Which pods its selectors pick, among the pods KubeRay really builds, is
checked with every other selector in tests/test_selectors.py ("prod-routed").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from infra import versions
from infra.config import PROD_MIN_ROUTER_REPLICAS
from infra.config.routing import CircuitBreaker, Routing
from infra.render import Rendered
from infra.serving.endpoint import public_service_name
from infra.serving.ports import RAY_PORTS
from infra.serving.router import (
    FRONT_CONTAINER,
    HEALTH_CHECK_INTERVAL_S,
    HEALTH_FAILURES,
    RETRY_FIRST_BACKOFF_MS,
    ROUTER_CONTAINER,
    ROUTER_METRICS,
    ROUTER_PORT,
    RUNTIME_THREADS_ENV,
    failure_args,
    router_name,
    router_pods,
)
from infra.serving.router_front import READINESS_PATH, ROUTER_BACKEND
from tests.e2e.loopback_http import SlowReplica, answer
from tests.harness import (
    ROUTING,
    SERVE_INGRESS,
    config_problems,
    manifests_of,
    prod_router_spec,
    render_config,
    render_routed,
    render_stack,
    stack_doc,
)
from twin.routing import TwinRouter

# The router's series its alerts read: the replicas it may send to, and its failed attempts by type.
ACTIVE = "vllm_router_active_workers"
ERRORS = "vllm_router_request_errors_total"


def _prod_router(worker_urls: list[str], log: Path, **routing: Any) -> tuple[TwinRouter, str]:
    """The pinned router with prod's rendered command (``routing`` over its `serving.routing`) in front of
    ``worker_urls``, and its metrics URL."""
    from twin.routing import start_router

    committed = stack_doc("prod")["config"].get("llm-platform:serving", {}).get("routing", {})
    spec = prod_router_spec(log.parent, {**committed, **routing})
    router, argv = start_router(spec.command, worker_urls, log, spec.front, env=spec.env)
    return router, f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"


def _router_samples(metrics_url: str, names: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """The samples of ``names`` in the router's exposition, as Prometheus' own parser reads it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name in names
    ]


def routed() -> Rendered:
    return render_routed("prod")


def _named(kind: str, name: str, rendered: Rendered | None = None) -> dict[str, Any]:
    (found,) = [m for m in manifests_of(rendered or routed(), kind) if m["metadata"]["name"] == name]
    return found


def _services() -> list[str]:
    return [rs["metadata"]["name"] for rs in manifests_of(routed(), "RayService")]


def _container(service: str, name: str) -> dict[str, Any]:
    pod = _named("Deployment", router_name(service))["spec"]["template"]["spec"]
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def test_routing_is_off_unless_asked_for() -> None:
    routers = {}
    for stack in (SERVE_INGRESS, "prod", "dev"):
        deployments = {d["metadata"]["name"] for d in manifests_of(render_stack(stack), "Deployment")}
        routers[stack] = {d for d in deployments if d.endswith("-router")}
    assert routers == {SERVE_INGRESS: set(), "prod": set(), "dev": {router_name("llama-31-8b")}}


def test_each_vllm_server_service_gets_its_router_and_the_load_balancer_sends_to_it() -> None:
    services = _services()
    assert len(services) == 2
    for service in services:
        dep = _named("Deployment", router_name(service))
        assert dep["spec"]["selector"] == {"matchLabels": router_pods(service)}
        public = _named("Service", public_service_name(service))
        assert public["spec"]["selector"] == router_pods(service)
        # The router answers on the replicas' port name: the target port and the clients' URL do not change.
        (port,) = public["spec"]["ports"]
        assert port["targetPort"] == ROUTER_PORT.name == RAY_PORTS.openai.name
        # The front holds that port; the router is on loopback behind it.
        front = _container(service, FRONT_CONTAINER)
        port_spec = {"name": ROUTER_PORT.name, "containerPort": RAY_PORTS.openai.number, "protocol": "TCP"}
        assert front["ports"] == [port_spec]
        assert front["readinessProbe"]["httpGet"] == {"path": READINESS_PATH, "port": ROUTER_PORT.name}
        assert ROUTER_PORT.name not in {p["name"] for p in _container(service, ROUTER_CONTAINER)["ports"]}


def test_the_routers_command_line_is_one_vllm_router_accepts() -> None:
    """Parsed by the pinned release's own parser: a flag or policy it does not know fails here."""
    router_args = pytest.importorskip("vllm_router.router_args", reason="pip install -r requirements-dev.txt")
    import argparse

    for service in _services():
        command = _container(service, ROUTER_CONTAINER)["command"]
        assert command[0] == "vllm-router"
        parser = argparse.ArgumentParser(exit_on_error=False)
        router_args.RouterArgs.add_cli_args(parser)
        args = router_args.RouterArgs.from_cli_args(parser.parse_args(command[1:]))
        assert args.service_discovery and args.service_discovery_namespace == "llm"
        assert args.service_discovery_port == RAY_PORTS.openai.number
        assert args.policy == "cache_aware" and args.cache_threshold == ROUTING["cache_threshold"]
        # Its API (with its keyless control routes) on loopback, behind the front; its metrics on the pod.
        assert args.host == "127.0.0.1" and args.port == ROUTER_BACKEND.number != ROUTER_PORT.number
        assert args.prometheus_port == ROUTER_METRICS.number
        assert args.selector == {
            "llm-platform/ray-service": service,
            "ray.io/node-type": "worker",
            "ray.io/group": f"gpu-{service}",
            "ray.io/serve": "true",
        }


def test_the_router_reads_pods_in_its_namespace_and_nothing_else() -> None:
    for service in _services():
        role = _named("Role", router_name(service))
        assert role["metadata"]["namespace"] == "llm"
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
        binding = _named("RoleBinding", router_name(service))
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_name(service), "namespace": "llm"}]
        spec = _named("Deployment", router_name(service))["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == router_name(service)
    # No ClusterRole or ClusterRoleBinding of its own.
    cluster_rbac = [
        m["metadata"]["name"]
        for kind in ("ClusterRole", "ClusterRoleBinding")
        for m in manifests_of(routed(), kind)
        if "router" in m["metadata"]["name"]
    ]
    assert cluster_rbac == []


def test_prod_routers_survive_a_node_and_a_zone() -> None:
    for service in _services():
        dep = _named("Deployment", router_name(service))
        spreads = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        zone = next(s for s in spreads if s["topologyKey"] == "topology.kubernetes.io/zone")
        assert zone["whenUnsatisfiable"] == "DoNotSchedule"
        assert zone["labelSelector"] == {"matchLabels": router_pods(service)}
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pdb = _named("PodDisruptionBudget", router_name(service))
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": router_pods(service)}}
        hpa = _named("HorizontalPodAutoscaler", router_name(service))
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": router_name(service),
        }
        assert hpa["spec"]["minReplicas"] == ROUTING["min_replicas"] >= PROD_MIN_ROUTER_REPLICAS


def test_the_replicas_serve_port_admits_the_router_and_no_longer_the_vpc() -> None:
    for service in _services():
        plain = _named("NetworkPolicy", f"{service}-ray-serve", render_stack("prod"))
        routed_policy = _named("NetworkPolicy", f"{service}-ray-serve")
        assert any("ipBlock" in p for p in plain["spec"]["ingress"][0]["from"])
        (rule,) = routed_policy["spec"]["ingress"]
        assert not any("ipBlock" in p for p in rule["from"])
        assert {"podSelector": {"matchLabels": router_pods(service)}} in rule["from"]
        assert rule["ports"] == [{"protocol": "TCP", "port": RAY_PORTS.openai.number}]
        router_policy = _named("NetworkPolicy", router_name(service))
        ingress_ports = sorted(p["port"] for r in router_policy["spec"]["ingress"] for p in r["ports"])
        assert ingress_ports == sorted([ROUTER_PORT.number, ROUTER_METRICS.number])
        egress_ports = sorted(p["port"] for r in router_policy["spec"]["egress"] for p in r["ports"])
        # Its replicas' servers and the Kubernetes API; DNS comes from the namespace's own policy.
        assert egress_ports == [443, RAY_PORTS.openai.number]


def test_router_manifests_validate_against_the_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kinds = {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "Service",
        "ConfigMap",
    }
    checked = 0
    for manifest in routed().manifests:
        if manifest.get("kind") in kinds and "router" in manifest["metadata"]["name"]:
            kubernetes_validate.validate(
                json.loads(json.dumps(manifest)), f"{versions.KUBERNETES_VERSION}.0", strict=True
            )
            checked += 1
    # Each router's eight objects, and the ClusterIP Service the gateway reaches it by (gateway.upstream_name).
    assert checked == 9 * len(_services())


def test_the_routers_pod_monitor_scrapes_its_metrics_port() -> None:
    for service in _services():
        monitor = _named("PodMonitor", router_name(service))
        assert monitor["spec"]["selector"] == {"matchLabels": router_pods(service)}
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [ROUTER_METRICS.name]


@pytest.mark.parametrize(
    ("stack", "routing", "expect"),
    [
        ("prod", {"enabled": True, "min_replicas": 1}, "serving.routing.min_replicas: prod keeps at least 2"),
        (SERVE_INGRESS, {"enabled": True}, "serving.routing.enabled: no service runs the vllm-server layout"),
        ("prod", {"enabled": True, "policy": "kv_aware", "min_replicas": 2}, "serving.routing.policy"),
        ("prod", {"enabled": True, "min_replicas": 3, "max_replicas": 2}, "serving.routing"),
    ],
)
def test_bad_routing_is_one_line_naming_the_key(stack: str, routing: dict[str, Any], expect: str) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["serving"] = {**raw.get("serving", {}), "routing": routing}

    problems = config_problems(stack, change)
    assert any(p.startswith(f"config error: {expect}") for p in problems), problems


def _with_report(raw: dict[str, Any], report: str) -> None:
    raw["serving"] = {**raw.get("serving", {}), "routing": {**ROUTING, "whatif_report": report}}


def test_the_preview_prints_the_recorded_whatifs_one_line_result(tmp_path: Path) -> None:
    report = tmp_path / "prod.json"
    summary = "what-if (prod): cache_aware hit 40% TTFT p50 90 ms; round_robin hit 20% TTFT p50 120 ms"
    report.write_text(json.dumps({"summary": summary, "results": []}))
    doc = copy.deepcopy(stack_doc("prod"))
    config = doc["config"]
    routing = {**ROUTING, "whatif_report": str(report)}
    config["llm-platform:serving"] = {**config.get("llm-platform:serving", {}), "routing": routing}
    log = render_config(doc, "prod-whatif").log
    assert f"routing {summary} [{report}]" in log
    # Without a report named, no such line.
    assert not [line for line in render_routed("prod").log if line.startswith("routing what-if")]


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (None, "does not exist (make whatif STACK=<stack> writes build/whatif/<stack>.json)"),
        ("[1, 2", "is not a what-if report: JSONDecodeError"),
        ('{"results": []}', "is not a what-if report: no one-line `summary`"),
        ('{"summary": "a\\nb"}', "is not a what-if report: no one-line `summary`"),
    ],
)
def test_a_whatif_report_that_does_not_read_is_one_line_naming_the_key(
    tmp_path: Path, content: str | None, expect: str
) -> None:
    report = tmp_path / "prod.json"
    if content is not None:
        report.write_text(content)
    problems = config_problems("prod", lambda raw: _with_report(raw, str(report)))
    assert problems == [f"config error: serving.routing.whatif_report: {report} {expect}"], problems


@pytest.mark.parametrize(
    ("request_cpu", "floor", "limit"),
    [("1", "2", "2"), ("500m", "2", "2"), ("3", "2", "6000m"), ("1500m", "2", "3000m")],
)
def test_a_cpu_limit_is_never_below_twice_the_request(request_cpu: str, floor: str, limit: str) -> None:
    """Kubernetes refuses a limit below the request: a router or gateway given more CPU than the floor gets twice
    its request."""
    from infra.config import quantity_value
    from infra.serving.replicated import cpu_limit

    assert cpu_limit(request_cpu, floor) == limit
    got, asked = quantity_value(limit), quantity_value(request_cpu)
    assert got is not None and asked is not None and got >= 2 * asked


def test_a_router_given_more_cpu_than_its_limits_floor_keeps_a_valid_limit() -> None:
    doc = copy.deepcopy(stack_doc("prod"))
    doc["config"]["llm-platform:serving"] = {
        **doc["config"].get("llm-platform:serving", {}),
        "routing": {**ROUTING, "cpu": "3"},
    }
    for dep in manifests_of(render_config(doc, "prod-router-cpu"), "Deployment"):
        if dep["metadata"]["name"].endswith("-router"):
            containers = {c["name"]: c["resources"] for c in dep["spec"]["template"]["spec"]["containers"]}
            assert containers["router"] == {
                "requests": {"cpu": "3", "memory": "1Gi"},
                "limits": {"cpu": "6000m", "memory": "1Gi"},
            }
            assert containers["front"]["limits"]["cpu"] == "500m"
            env = {e["name"]: e["value"] for e in _router_env(dep)}
            # Three cores' request, three runtime threads, whatever the limit or the node has.
            assert env == {RUNTIME_THREADS_ENV: "3"}


def _router_env(deployment: dict[str, Any]) -> list[dict[str, str]]:
    (router,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == ROUTER_CONTAINER]
    return list(router.get("env", []))


def test_the_router_runs_as_many_runtime_threads_as_its_cpu_request_has_cores() -> None:
    """Not one per node core: prod's system nodes have 8, and 8 threads would spend the 2-core quota in a
    quarter of each CFS period and leave the pod throttled for the rest. Nor one per core of the limit:
    a second worker costs each request more CPU (benchmarks/router_hop.py), and the autoscaler holds the
    router below its request."""
    from infra.config import quantity_value

    for service in _services():
        router = _container(service, ROUTER_CONTAINER)
        assert quantity_value(router["resources"]["requests"]["cpu"]) == 1
        assert quantity_value(router["resources"]["limits"]["cpu"]) == 2
        assert router["env"] == [{"name": RUNTIME_THREADS_ENV, "value": "1"}]


def test_a_fractional_cpu_request_counts_as_a_whole_runtime_thread() -> None:
    from infra.serving.router import runtime_threads

    assert runtime_threads("500m") == 1
    assert runtime_threads("1") == 1
    assert runtime_threads("1500m") == 2
    assert runtime_threads("3") == 3


def test_the_pinned_router_starts_the_runtime_threads_its_environment_names(tmp_path: Path) -> None:
    """The rendered environment, as the twin and the benchmark start the router, sets the pinned release's
    thread count: asked for more threads than this machine has cores, it runs exactly that many."""
    import os

    from localserve.processes import process_name, threads
    from tests.e2e.loopback_http import LoopbackHttp
    from twin.routing import start_router

    cores = os.cpu_count() or 1
    # A request of cores + 1: more threads than cores, so the count is the env's.
    spec = prod_router_spec(tmp_path, {**ROUTING, "cpu": str(cores + 1)})
    assert spec.env == {RUNTIME_THREADS_ENV: str(cores + 1)}
    replica = LoopbackHttp(SlowReplica)
    try:
        router, _ = start_router(spec.command, [replica.base_url], tmp_path / "router.log", spec.front, env=spec.env)
        try:
            names = [process_name(tid) for tid in threads(router.child.proc.pid)]
        finally:
            router.stop()
    finally:
        replica.stop()
    assert names.count("tokio-rt-worker") == cores + 1, names


def test_the_routers_alert_reads_a_series_the_pinned_router_exports_and_the_label_its_monitor_adds(
    tmp_path: Path,
) -> None:
    """LlmRouterHasNoReplica: `vllm_router_active_workers` counts the replicas the router may send to, with no
    label of its own to group by, and the RayService arrives as the label the PodMonitor's podTargetLabels
    entry becomes (the Prometheus Operator's sanitizeLabelName, mirrored in twin/prometheus_operator.py)."""
    import httpx

    from infra.serving import alerts
    from infra.serving.router import ROUTER_OF
    from tests.e2e.loopback_http import LoopbackHttp, SlowReplica
    from twin.prometheus_operator import sanitize_label_name

    (family,) = [f for f in alerts.METRIC_INVENTORY if f.prefix == "vllm_router_"]
    assert family.names[:2] == (ACTIVE, ERRORS)  # the third, the attempts' outcomes: test_router_failures.py
    assert alerts.ROUTER_OF_LABEL == sanitize_label_name(ROUTER_OF) == "llm_platform_router_of"
    (monitor,) = [
        m for m in manifests_of(routed(), "PodMonitor") if m["metadata"]["name"] == router_name(_services()[0])
    ]
    assert monitor["spec"]["podTargetLabels"] == [ROUTER_OF]

    replicas = [LoopbackHttp(SlowReplica), LoopbackHttp(SlowReplica)]
    router, metrics_url = _prod_router([r.base_url for r in replicas], tmp_path / "router.log")
    try:
        seen = [_router_samples(metrics_url, (ACTIVE,))]
        # What its discovery does when the replicas' pods leave (twin.routing.Discovery uses the same route).
        for replica in replicas:
            url = replica.base_url.removesuffix("/v1")
            httpx.post(f"http://127.0.0.1:{router.router_port}/remove_worker", params={"url": url}, timeout=10)
        seen.append(_router_samples(metrics_url, (ACTIVE,)))
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    assert seen == [[(ACTIVE, {}, 2.0)], [(ACTIVE, {}, 0.0)]]


class _Answering(SlowReplica):
    """A replica's server that is healthy and answers every generation request with the class's status."""

    status = 200
    posts = 0

    @override
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).posts += 1
        answer(self, self.status, b'{"choices": []}' if self.status == 200 else b'{"error": {"message": "no"}}')


def test_the_circuit_alert_reads_what_the_pinned_router_counts_when_its_replicas_fail(tmp_path: Path) -> None:
    """LlmRouterCircuitsOpen, against the pinned router with prod's rendered command: a replica that answers
    500 has its circuit opened, and the router then answers 503 itself, counting each attempt as
    `no_available_workers` while it still lists the replica as active (the alert's two series). A replica
    answering 401 (the guard's answer to a bad key) is not failing: no retry, no open circuit, so clients
    with bad keys can not take a model out of rotation for everyone."""
    import httpx

    from infra.serving import alerts
    from tests.e2e.loopback_http import LoopbackHttp

    (family,) = [f for f in alerts.METRIC_INVENTORY if f.prefix == "vllm_router_"]
    assert family.names[:2] == (ACTIVE, ERRORS)  # the third, the attempts' outcomes: test_router_failures.py

    class Replica(_Answering):
        pass

    replica = LoopbackHttp(Replica)
    # The circuit breaker on, with the release's own settings (it is off by default: test_router_failures.py).
    attempts, breaker = 5, CircuitBreaker(enabled=True)
    router, metrics_url = _prod_router(
        [replica.base_url], tmp_path / "router.log", attempts=attempts, circuit_breaker=breaker.model_dump()
    )
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}

    def post() -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body, timeout=60)

    def series() -> dict[tuple[str, str], float]:
        return {
            (name, labels.get("error_type", "")): value
            for name, labels, value in _router_samples(metrics_url, family.names)
        }

    try:
        Replica.status = 401
        # More bad keys than the circuit's failure threshold (10).
        refused = [post().status_code for _ in range(12)]
        bad_key_attempts = Replica.posts
        after_bad_keys = series()
        Replica.status, Replica.posts = 200, 0
        served = post().status_code
        Replica.status = 500
        answers = [post() for _ in range(4)]
        tried = Replica.posts - 1
        after_failures = series()
    finally:
        router.stop()
        replica.stop()

    assert refused == [401] * 12
    assert bad_key_attempts == 12  # not retried
    assert (ERRORS, alerts.ROUTER_NO_WORKER_ERROR) not in after_bad_keys
    assert served == 200
    # Two failed requests, each tried 5 times, open the circuit (10 failures); the rest never reach the replica.
    assert [a.status_code for a in answers] == [500, 500, 503, 503]
    assert tried == 2 * attempts == breaker.failures
    assert "No available workers" in answers[-1].text
    assert after_failures[(ERRORS, alerts.ROUTER_NO_WORKER_ERROR)] > 0
    assert after_failures[(ACTIVE, "")] == 1.0


def test_the_circuit_runbook_and_the_routing_docs_state_the_failure_policy_the_router_is_given() -> None:
    """The numbers an operator reads in the runbook and docs/routing.md are the config's defaults, and the
    rendered command carries the stack's (routing.failure_args)."""
    routing, breaker = Routing(), CircuitBreaker()
    rendered = _container(_services()[0], ROUTER_CONTAINER)["command"]
    assert rendered[rendered.index("--retry-max-retries") + 1] == str(ROUTING.get("attempts", routing.attempts))
    assert "--disable-circuit-breaker" in rendered
    on = Routing(circuit_breaker=CircuitBreaker(enabled=True, failures=7, window_s=30, open_s=15, close_after=2))
    command = " ".join(failure_args(on))
    for flag, value in (
        ("--cb-failure-threshold", 7),
        ("--cb-window-duration-secs", 30),
        ("--cb-timeout-duration-secs", 15),
        ("--cb-success-threshold", 2),
    ):
        assert f"{flag} {value}" in command
    assert "--disable-circuit-breaker" not in command
    root = Path(__file__).resolve().parents[1]
    runbook = " ".join((root / "docs/runbooks/LlmRouterCircuitsOpen.md").read_text().split())
    routing_doc = " ".join((root / "docs/routing.md").read_text().split())
    for text in (runbook, routing_doc):
        assert f"({breaker.failures} in {breaker.window_s} s by default)" in text
        assert f"nothing for `open_s` ({breaker.open_s} s)" in text
        assert f"`serving.routing.attempts` attempts in all ({routing.attempts} by default)" in text
    assert f"good attempts ({breaker.close_after} by default" in runbook
    assert f"`/health` every {HEALTH_CHECK_INTERVAL_S} s, out after {HEALTH_FAILURES} failures" in routing_doc
    assert f"every {HEALTH_CHECK_INTERVAL_S} s; {HEALTH_FAILURES} failures in a row" in runbook
    assert f"--health-failure-threshold {HEALTH_FAILURES}" in " ".join(rendered)
    assert f"backoff from {RETRY_FIRST_BACKOFF_MS} ms" in routing_doc
