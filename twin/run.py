"""One RayService's twin: the static checks, then the local cluster and the checks against it."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.serving.ports import RAY_PORTS
from localserve.otlp import OtlpReceiver
from localserve.processes import child_env, free_port
from twin import live, observe
from twin.checks import ParsedStart, model_groups_for, run_static_checks, scaled, shortfall
from twin.cluster import LOOPBACK, REPO, LocalCluster
from twin.deploy import Fitting, ModelInfo, TwinServeConfig, deploy, twin_serve_config, with_tracing
from twin.gateway import measure_gateway
from twin.render import RayServiceSpec
from twin.report import Report
from twin.routing import MAX_IMBALANCE, RouterSpec, imbalance, measure_split, with_policy
from twin.shape import TWIN_IDLE_TIMEOUT_S, fit_shape, pod_env
from twin.traces import chat_sender, check_traces
from twin.wake import WakeRun, WokenFront, router_has_no_worker, wake_through_gateway
from workloads.inference_server.catalog import Catalog

# KubeRay's worker readiness probe: failureThreshold 10 x periodSeconds 5.
ENDPOINT_TIMEOUT_S = 50.0
RUNNING_TIMEOUT_S = 480.0
SCALE_TO_ZERO_TIMEOUT_S = 180.0
PROGRESS_EVERY_S = 15.0
# Prod keeps at least this many OpenAI ingress replicas (issue: no single point of failure).
PROD_MIN_INGRESS = 2
# A replica's address file is written once its server is healthy, which RUNNING already waited for.
ADDRESS_TIMEOUT_S = 60.0


@dataclass
class Session:
    """A RayService's local cluster and the config deployed on it."""

    service: RayServiceSpec
    cluster: LocalCluster
    serve: TwinServeConfig
    model_groups: dict[str, str]
    # The head's own metrics endpoints (the autoscaler's, the dashboard's): port name -> live port.
    head_ports: dict[str, int] = field(default_factory=dict)
    # Where the deployed config sends its traces (twin.deploy.with_tracing); None when not traced.
    receiver: OtlpReceiver | None = None
    # The router the render runs (or would run) in front of this RayService's replicas (twin/routing.py).
    router: RouterSpec | None = None

    @property
    def name(self) -> str:
        """The RayService's name (every printed line carries it)."""
        return self.service.name


def prepare(
    service: RayServiceSpec,
    report: Report,
    *,
    autoscaling: Mapping[str, Any],
    head: ParsedStart,
    model_groups: Mapping[str, str],
    workdir: Path,
    model_dir: Path,
    http_port: int,
    fitting: Fitting | None = None,
    idle_timeout_s: float | None = TWIN_IDLE_TIMEOUT_S,
    traced: bool = False,
    api_key: str | None = None,
    router: RouterSpec | None = None,
) -> Session:
    """Fits the RayService to this machine and prints every substitution; starts nothing but,
    when ``traced``, the OTLP receiver the deployed config sends its traces to.

    ``api_key``: the key to serve with (default: one generated for this session)."""
    fitted = fit_shape(service.name, autoscaling, head, http_port, pod_env(service.cluster), idle_timeout_s)
    serve = twin_serve_config(
        service.serve_config(),
        model_dir=model_dir,
        secrets_dir=workdir / "s",
        http_port=http_port,
        api_key=api_key,
        fitting=fitting,
    )
    receiver = OtlpReceiver().start() if traced else None
    if receiver is not None:
        serve.substitutions.append(with_tracing(serve.config, receiver.endpoint))
    head_ports = {RAY_PORTS.autoscaler_metrics.name: free_port(), RAY_PORTS.dashboard_metrics.name: free_port()}
    for line in fitted.substitutions + serve.substitutions:
        report.sub(service.name, line)
    report.sub(
        service.name,
        "head: the autoscaler's and the dashboard's metrics on free ports "
        + ", ".join(f"{name} {port}" for name, port in head_ports.items()),
    )
    env = child_env(
        {
            "PYTHONPATH": f"{REPO}:{REPO / 'workloads'}",
            # Ray's own knobs for those two ports (ray.autoscaler._private.constants, ray.dashboard.consts).
            "AUTOSCALER_METRIC_PORT": str(head_ports[RAY_PORTS.autoscaler_metrics.name]),
            "DASHBOARD_METRIC_PORT": str(head_ports[RAY_PORTS.dashboard_metrics.name]),
        }
    )
    cluster = LocalCluster(fitted.shape, workdir, env, head_proxy_port=http_port)
    return Session(
        service=service,
        cluster=cluster,
        serve=serve,
        model_groups=dict(model_groups),
        head_ports=head_ports,
        receiver=receiver,
        router=router,
    )


def node_counts(session: Session) -> str:
    """The live nodes by type, e.g. ``ray.head.default x1, ingress x1``."""
    counts = Counter(node.node_type for node in session.cluster.nodes())
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def start_and_deploy(session: Session, report: Report) -> None:
    """Starts the head (whose autoscaler starts the rest) and deploys the serve config."""
    report.step(session.name, "cluster: starting the head")
    session.cluster.start()
    session.cluster.connect()
    report.step(session.name, f"nodes: {node_counts(session)}; deploying serveConfigV2")
    deploy(session.serve.config)


def wait_running(session: Session, report: Report, timeout_s: float = RUNNING_TIMEOUT_S) -> bool:
    """Waits until every application is RUNNING, printing progress; fails fast on DEPLOY_FAILED."""
    apps = [str(a.get("name")) for a in session.serve.config.get("applications") or []]
    last_at, last_line = 0.0, ""
    outcome: dict[str, str] = {}

    def settled() -> bool:
        nonlocal last_at, last_line
        details = live.serve_details()
        states = {app: live.app_status(details, app) for app in apps}
        failed = {app: msg for app, (status, msg) in states.items() if status == "DEPLOY_FAILED"}
        if failed:
            outcome.update(failed)
            return True
        line = f"nodes: {node_counts(session)}; " + "; ".join(live.describe(details, app) for app in apps)
        if line != last_line or time.monotonic() - last_at > PROGRESS_EVERY_S:
            report.step(session.name, line)
            last_at, last_line = time.monotonic(), line
        return all(status == "RUNNING" for status, _ in states.values())

    started = time.monotonic()
    done = live.wait_for(settled, timeout_s)
    took = time.monotonic() - started
    if outcome:
        for app, message in outcome.items():
            report.fail(session.name, f"application {app}: DEPLOY_FAILED after {took:.0f}s: {message.strip()[:600]}")
        return False
    return report.check(
        session.name,
        done,
        f"application {', '.join(apps)}: RUNNING after {took:.0f}s"
        if done
        else f"application {', '.join(apps)}: not RUNNING after {timeout_s:.0f}s",
    )


def run_service(
    service: RayServiceSpec,
    report: Report,
    *,
    stack: str | None,
    model_names: Mapping[str, str] | None,
    workdir: Path,
    model_dir: Path | None,
    objects: list[dict[str, Any]] | None = None,
    faults: bool = False,
    router: RouterSpec | None = None,
) -> None:
    """Everything the twin checks for one RayService; with the render's ``objects``, its monitoring too
    (and the alerts' faults when ``faults``); with a ``router``, the request router in front of it."""
    failed_before = len(report.failed)
    static = run_static_checks(service, report, model_names)
    if model_dir is None:
        return
    if static is None or len(report.failed) > failed_before:
        # Already a failure; a local cluster would only wait for what can not happen (a node type no
        # bundle fits, a replica that is never placed) until its timeout.
        report.note(service.name, "local run skipped: Ray's own code rejects this RayService as rendered")
        return
    autoscaling, started = static

    session = prepare(
        service,
        report,
        autoscaling=autoscaling,
        head=started["headgroup"],
        model_groups=model_groups_for(service, model_names),
        workdir=workdir,
        model_dir=model_dir,
        http_port=free_port(),
        traced=True,
        router=router,
    )
    try:
        start_and_deploy(session, report)
        idle_next = run_live_checks(session, report, stack)
        if objects is not None and woken_models(session):
            report.note(
                service.name,
                "monitoring not run: its faults go straight to a replica's server, and this model is at zero "
                "between them (only the gateway wakes it); the same rules and monitors run on any stack whose "
                "vllm-server models keep a replica",
            )
        elif objects is not None:
            run_observability(session, report, objects, workdir / "prometheus", faults=faults)
        if idle_next:
            # After the monitoring, whose last faults send no request: the models' idle time to zero has
            # begun under them, where before the monitoring it was a wait of its own (about 80 s).
            check_scale_to_zero_sampled(session, report)
    except Exception as err:
        report.fail(service.name, f"local run: {type(err).__name__}: {err}")
        report.note(service.name, "head log tail:\n" + session.cluster.log_tail(15))
        report.note(service.name, "autoscaler log tail:\n" + session.cluster.monitor_log_tail(15))
    finally:
        report.step(service.name, "stopping the local cluster")
        session.cluster.stop()
        if session.receiver is not None:
            session.receiver.stop()


def run_live_checks(session: Session, report: Report, stack: str | None) -> bool:
    """The live checks, one line each, with the serve Service's endpoints sampled throughout.

    Returns whether Serve's ingress serves a model at min_replicas 0 whose scale to zero and wake are
    still to check (check_scale_to_zero_sampled, once the session's other checks are done).
    """
    woken = woken_models(session)
    if woken:
        run_woken_checks(session, report, woken)
        return False
    if server_models(session):
        run_server_checks(session, report)
        return False
    sampler = live.EndpointSampler(session.cluster, session.service.excludes_head)
    running = wait_running(session, report) and wait_serve_endpoint(session, report, sampler)
    sampler.start()
    try:
        check_loopback(session, report)
        if running:
            check_requests(session, report, sampler)
            port = sampler.ready_port()
            if port is not None:
                check_session_traces(session, report, f"http://{LOOPBACK}:{port}/v1")
            check_every_worker_ready(session, report)
            check_ingress_replicas(session, report, stack)
    finally:
        sampler.stop()
        report.check(session.name, *sampler.summary())
    return running and any(model.min_replicas == 0 for model in session.serve.models)


def check_scale_to_zero_sampled(session: Session, report: Report) -> None:
    """check_scale_to_zero with the serve Service's endpoints sampled throughout: the ingress node keeps
    answering while the model's replica and node go, and while the request at zero wakes them."""
    sampler = live.EndpointSampler(session.cluster, session.service.excludes_head)
    # The monitoring's last fault froze the processes answering the probes; they answer again once resumed.
    if not live.wait_for(lambda: bool(sampler.sample().ready), ENDPOINT_TIMEOUT_S):
        report.fail(
            session.name,
            f"scale to zero: no node the serve Service selects answered {sampler.probe_name} within "
            f"{ENDPOINT_TIMEOUT_S:.0f}s, so no request could wake a model",
        )
        return
    sampler.start()
    try:
        check_scale_to_zero(session, report, sampler)
    finally:
        sampler.stop()
        report.check(session.name, *sampler.summary())


def wait_serve_endpoint(
    session: Session, report: Report, sampler: live.EndpointSampler, timeout_s: float = ENDPOINT_TIMEOUT_S
) -> bool:
    """Waits for the first Ready endpoint of the serve Service, as KubeRay waits before it calls the RayService Ready.

    A proxy answers /-/healthz only once the controller has told it that its
    node holds a replica, a moment after the application is RUNNING; from
    then on the Service must never be empty (the sampler checks that).
    """
    started = time.monotonic()
    found = live.wait_for(lambda: bool(sampler.sample().ready), timeout_s)
    took = time.monotonic() - started
    ready = ", ".join(sampler.latest.ready) if sampler.latest else ""
    return report.check(
        session.name,
        found,
        f"ready: the serve Service has an endpoint ({ready}) {took:.0f}s after RUNNING"
        if found
        else f"ready: no node the serve Service selects answered {sampler.probe_name} within {timeout_s:.0f}s "
        "of RUNNING",
    )


def check_loopback(session: Session, report: Report) -> None:
    """Every Ray node of the local cluster is on 127.0.0.1 (as Ray's GCS reports it)."""
    nodes = session.cluster.nodes()
    elsewhere = [f"{n.node_type} at {n.ip}" for n in nodes if n.ip != "127.0.0.1"]
    report.check(
        session.name,
        not elsewhere,
        f"loopback: all {len(nodes)} Ray nodes on 127.0.0.1" if not elsewhere else f"nodes off loopback: {elsewhere}",
    )


def _first_model(session: Session) -> str:
    return session.serve.models[0].model_id


def check_requests(session: Session, report: Report, sampler: live.EndpointSampler) -> None:
    """A chat completion through the stack's auth, and a request without a key refused with 401."""
    port = sampler.ready_port()
    if port is None:
        report.fail(session.name, "chat: no node the serve Service selects is Ready, so no request can arrive")
        return
    model_id = _first_model(session)
    started = time.monotonic()
    try:
        text = live.chat(port, session.serve.api_key, model_id)
    except Exception as err:
        report.fail(session.name, f"chat: {model_id} through the serve Service's endpoint failed: {err}")
    else:
        report.ok(
            session.name, f"chat: {model_id} answered {text!r} with the API key in {time.monotonic() - started:.0f}s"
        )
    status = live.status_without_key(port)
    report.check(session.name, status == 401, f"auth: a request without an API key gets {status} (want 401)")


def check_session_traces(session: Session, report: Report, base_url: str) -> None:
    """One chat at ``base_url`` arrives at the session's OTLP receiver as vLLM's span of it (twin.traces)."""
    if session.receiver is None:
        return
    send = chat_sender(base_url, session.serve.api_key, _first_model(session))
    check_traces(report, session.name, session.receiver, send)


def check_every_worker_ready(session: Session, report: Report, settle_s: float = 30.0) -> None:
    """Every worker pod passes KubeRay's readiness probe (a worker pod that never does is stuck NotReady)."""
    not_ready: list[str] = []

    def all_ready() -> bool:
        workers = [n for n in session.cluster.nodes() if not n.is_head]
        not_ready[:] = [f"{n.node_type}#{n.node_id[-2:]}" for n in workers if not live.healthz(n.proxy_port)]
        return not not_ready

    ok = live.wait_for(all_ready, settle_s)
    report.check(
        session.name,
        ok,
        "readiness: every worker node's Serve proxy answers /-/healthz"
        if ok
        else f"readiness: {', '.join(not_ready)} never answer /-/healthz: those pods stay NotReady "
        "(a worker pod without a replica has no proxy)",
    )


def _ingress(details: dict[str, Any], app: str, model_ids: list[str]) -> dict[str, dict[str, Any]]:
    return {
        name: d
        for name, d in live.deployments(details, app).items()
        if not any(live.is_model_deployment(name, m) for m in model_ids)
    }


def check_ingress_replicas(session: Session, report: Report, stack: str | None) -> None:
    """The OpenAI ingress runs at least its catalogue minimum (at least 2 on different nodes in prod)."""
    details = live.serve_details()
    for app, minimum in session.serve.ingress_min_replicas.items():
        model_ids = [m.model_id for m in session.serve.models if m.app == app]
        ingress = _ingress(details, app, model_ids)
        replicas = [r for d in ingress.values() for r in live.running_replicas(d)]
        nodes = {r.get("node_id") for r in replicas}
        want = max(minimum or 1, PROD_MIN_INGRESS if stack == "prod" else 1)
        ok = len(replicas) >= want and len(nodes) >= min(want, PROD_MIN_INGRESS if stack == "prod" else 1)
        report.check(
            session.name,
            ok,
            f"ingress ({app}): {len(replicas)} RUNNING replicas of {', '.join(ingress) or 'the OpenAI ingress'} "
            f"on {len(nodes)} nodes (want >= {want}" + (", spread over nodes in prod)" if stack == "prod" else ")"),
        )


def check_scale_to_zero(session: Session, report: Report, sampler: live.EndpointSampler) -> None:
    """Models at min_replicas 0: after the idle time no replica and no node of their group; a request wakes them."""
    for model in session.serve.models:
        if model.min_replicas != 0:
            continue
        group = session.model_groups.get(model.model_id, "?")
        started = time.monotonic()

        def gone(model_id: str = model.model_id, app: str = model.app, group: str = group) -> bool:
            details = live.serve_details()
            replicas = [
                r
                for name, d in live.deployments(details, app).items()
                if live.is_model_deployment(name, model_id)
                for r in live.live_replicas(d)
            ]
            return not replicas and not any(n.node_type == group for n in session.cluster.nodes())

        at_zero = live.wait_for(gone, SCALE_TO_ZERO_TIMEOUT_S)
        took = time.monotonic() - started
        report.check(
            session.name,
            at_zero,
            f"scale to zero ({model.model_id}): no replica and no {group} node after {took:.0f}s"
            if at_zero
            else f"scale to zero ({model.model_id}): still a replica or a {group} node after {took:.0f}s",
        )
        if not at_zero:
            continue
        _check_wake(session, report, sampler, model.model_id, group)


def _check_wake(session: Session, report: Report, sampler: live.EndpointSampler, model_id: str, group: str) -> None:
    port = sampler.ready_port()
    if port is None:
        report.fail(session.name, f"wake ({model_id}): at zero, no node the serve Service selects is Ready")
        return
    started = time.monotonic()
    try:
        live.chat(port, session.serve.api_key, model_id)
    except Exception as err:
        report.fail(session.name, f"wake ({model_id}): the request at zero failed: {err}")
        return
    woke = any(n.node_type == group for n in session.cluster.nodes())
    report.check(
        session.name,
        woke,
        f"wake ({model_id}): the request at zero was answered in {time.monotonic() - started:.0f}s "
        + (f"on a new {group} node" if woke else f"but no {group} node is up"),
    )


def woken_models(session: Session) -> list[ModelInfo]:
    """The vllm-server models at min_replicas 0: the model gateway wakes them (twin/wake.py)."""
    return [m for m in server_models(session) if m.min_replicas == 0]


def run_woken_checks(session: Session, report: Report, models: list[ModelInfo]) -> None:
    """The live checks of models the gateway wakes: at zero, woken through the gateway and router, back to zero.

    The rest of the vllm-server checks (replicas per node, the guard, the
    router's spread) are the ones a model at min_replicas >= 1 gets: they need
    replicas that stay, and a woken model's go after the twin's downscale delay.
    """
    if not wait_running(session, report):
        return
    for model in models:
        check_woken(session, report, model)


def _at_zero(session: Session, model: ModelInfo) -> bool:
    group = session.model_groups.get(model.model_id)
    return not _replicas_of(model) and not any(n.node_type == group for n in session.cluster.nodes())


def check_woken(session: Session, report: Report, model: ModelInfo) -> None:
    """One model at zero: a request through the gateway wakes it (a new node, a replica), then it sleeps again."""
    spec, group, what = session.router, session.model_groups.get(model.model_id, "?"), f"wake ({model.model_id})"
    if spec is None or spec.gateway is None or model.model_id not in spec.gateway.wake or model.address_dir is None:
        report.fail(session.name, f"{what}: the render runs no gateway that wakes this model")
        return
    report.check(
        session.name,
        _at_zero(session, model),
        f"at zero ({model.model_id}): no replica and no {group} node before the first request",
    )

    def then(run: WakeRun, router_root: str) -> None:
        woke = any(n.node_type == group for n in session.cluster.nodes())
        added = [url for _, verb, url in run.events if verb == "add"]
        report.check(
            session.name,
            run.status == 200 and bool(run.content) and woke and len(added) == 1,
            f"{what}: the request at zero, through the gateway and the model's router: {run.status} in "
            f"{run.seconds:.0f}s, {'on a new ' + group + ' node' if woke else 'but no ' + group + ' node is up'}, "
            f"the router given {len(added)} replica by discovery (want 200: held while Serve started a replica "
            "for the gateway's wake)",
        )
        report.check(
            session.name,
            run.next_status == 200 and run.wakes == 1,
            f"{what}: the next request, awake: {run.next_status} in {run.next_seconds:.1f}s, the gateway's wakes "
            f"{run.wakes:g} (want 200 and 1: one wake for the model, none once a replica answers)",
        )
        started = time.monotonic()
        gone = live.wait_for(lambda: _at_zero(session, model), SCALE_TO_ZERO_TIMEOUT_S)
        report.check(
            session.name,
            gone,
            f"scale to zero ({model.model_id}): no replica and no {group} node {time.monotonic() - started:.0f}s "
            "after the request"
            if gone
            else f"scale to zero ({model.model_id}): still a replica or a {group} node after "
            f"{SCALE_TO_ZERO_TIMEOUT_S:.0f}s",
        )
        if gone:
            empty = live.wait_for(lambda: router_has_no_worker(router_root, model.model_id, session.serve.api_key), 30)
            report.check(
                session.name,
                empty,
                f"router ({model.model_id}): back to no worker at zero, so the next request wakes the model again",
            )

    report.sub(
        session.name,
        f"wake ({model.model_id}): the rendered router (discovery replaced by the twin's, with no worker at zero) "
        "and gateway (its wake URL the head's Serve proxy)",
    )
    try:
        front = woken_front(session, report, model)
        try:
            wake_through_gateway(front, session.serve.api_key, then)
        finally:
            front.stop()
    except Exception as err:
        report.fail(session.name, f"{what}: {type(err).__name__}: {err}")


def woken_front(session: Session, report: Report, model: ModelInfo) -> WokenFront:
    """The rendered router and gateway in front of a woken model of the session, its wake URL the head's
    Serve proxy (twin/wake.py); the caller stops it."""
    assert session.router is not None and model.address_dir is not None
    return WokenFront(
        session.router,
        _keys_file(session.serve),
        model.address_dir,
        f"http://{LOOPBACK}:{session.cluster.head_proxy_port}/",
        model.model_id,
        session.cluster.workdir,
        lambda line: report.sub(session.name, line),
    )


def server_models(session: Session) -> list[ModelInfo]:
    """The models served in the vllm-server layout (vLLM's own server in each replica, no Serve ingress)."""
    return [m for m in session.serve.models if m.layout == "vllm-server"]


def run_server_checks(session: Session, report: Report) -> None:
    """The live checks of the vllm-server layout: the replicas' servers are what the serve Service reaches.

    No ingress replicas and no scale to zero here: requests never pass
    through Serve; a model at min_replicas 0 (woken by the gateway) gets
    run_woken_checks instead.
    """
    models = server_models(session)
    folders = [m.address_dir for m in models if m.address_dir is not None]
    sampler = live.ServerSampler(session.cluster, session.service.excludes_head, address_dirs=folders)
    running = wait_running(session, report)
    replicas: dict[str, list[dict[str, Any]]] = {}
    if running:
        for model in models:
            replicas[model.model_id] = check_server_replicas(session, report, model)
        running = wait_serve_endpoint(session, report, sampler)
    sampler.start()
    try:
        check_loopback(session, report)
        if running:
            for model in models:
                check_server_requests(session, report, model, replicas.get(model.model_id) or [])
                check_routing(session, report, model, replicas.get(model.model_id) or [])
            first = replicas.get(models[0].model_id) or []
            if first:
                check_session_traces(session, report, str(first[0].get("url", "")))
            check_every_server_ready(session, report, sampler)
    finally:
        sampler.stop()
        report.check(session.name, *sampler.summary())


def _replicas_of(model: ModelInfo) -> list[dict[str, Any]]:
    folders = [model.address_dir] if model.address_dir is not None else []
    return [r for r in live.replica_addresses(folders) if r.get("model_id") == model.model_id]


def _node_label(session: Session, node_id: str) -> str:
    for node in session.cluster.nodes():
        if node.node_id == node_id:
            return f"{node.node_type}#{node_id[-2:]}"
    return f"node {node_id[:8]} (gone)"


def one_replica_per_node(session: Session, model: ModelInfo) -> bool:
    """Whether a node of the model's group holds one replica only (then the replicas must be on distinct nodes)."""
    group = session.model_groups.get(model.model_id)
    node = next((t.resources for t in session.cluster.shape.worker_types if t.name == group), None)
    if node is None or not model.actor_options:
        return False
    return holds_one(model.actor_options, node)


def holds_one(actor_options: Mapping[str, Any], node: Mapping[str, float]) -> bool:
    """Whether a node with ``node``'s resources has room for one actor with ``actor_options``, not two."""
    from ray._common.utils import resources_from_ray_options

    need = {str(k): float(v) for k, v in resources_from_ray_options(dict(actor_options)).items() if v}
    return not shortfall(need, node) and bool(shortfall(scaled(need, 2), node))


def check_server_replicas(session: Session, report: Report, model: ModelInfo) -> list[dict[str, Any]]:
    """The model runs min_replicas servers, one address file each; on distinct nodes where a node holds one."""
    found: list[dict[str, Any]] = []

    def counted() -> bool:
        found[:] = _replicas_of(model)
        return len(found) == model.min_replicas

    live.wait_for(counted, ADDRESS_TIMEOUT_S)
    nodes = {str(r.get("node_id")) for r in found}
    spread = one_replica_per_node(session, model)
    ok = len(found) == model.min_replicas and (not spread or len(nodes) == len(found))
    where = ", ".join(sorted(_node_label(session, n) for n in nodes)) or "no node"
    report.check(
        session.name,
        ok,
        f"replicas ({model.model_id}): {len(found)} servers (want min_replicas {model.min_replicas}) on "
        f"{len(nodes)} nodes ({where})" + (", one per node as a node of its group holds one replica" if spread else ""),
    )
    return found


def check_server_requests(session: Session, report: Report, model: ModelInfo, replicas: list[dict[str, Any]]) -> None:
    """Through each replica's own server: a chat with the key answers, no key gets 401, /health is open."""
    if not replicas:
        report.fail(session.name, f"chat ({model.model_id}): no replica published a server address")
        return
    refused: list[int] = []
    health: list[int] = []
    metrics: list[str] = []
    for replica in replicas:
        url = str(replica.get("url", ""))
        root = live.server_root(url)
        node = _node_label(session, str(replica.get("node_id")))
        started = time.monotonic()
        try:
            text = live.chat_at(url, session.serve.api_key, model.model_id)
        except Exception as err:
            report.fail(session.name, f"chat ({model.model_id}): the server on {node} at {url} failed: {err}")
        else:
            report.ok(
                session.name,
                f"chat ({model.model_id}): the server on {node} answered {text!r} with the API key "
                f"in {time.monotonic() - started:.0f}s",
            )
        refused.append(live.status_of(f"{root}/v1/models"))
        health.append(live.status_of(f"{root}/health"))
        metrics.append(live.metrics_answer(str(replica.get("metrics_url", ""))))
    report.check(
        session.name,
        all(code == 401 for code in refused),
        f"auth ({model.model_id}): without an API key each server's /v1/models gets {refused} (want 401)",
    )
    report.check(
        session.name,
        all(code == 200 for code in health),
        f"health ({model.model_id}): without a key each server's /health gets {health} (want 200: the readiness "
        "probe carries no key)",
    )
    report.check(
        session.name,
        all(answer == "ok" for answer in metrics),
        f"metrics ({model.model_id}): each server's metrics port, asked without a key: {metrics} "
        f"(want ok: vLLM's {live.QUEUE_GAUGE} for the monitoring stack)",
    )


def check_routing(session: Session, report: Report, model: ModelInfo, replicas: list[dict[str, Any]]) -> None:
    """The router in front of the model's replicas spreads one keep-alive client's requests over them."""
    spec = session.router
    if spec is None or len(replicas) < 2:
        return
    state = "on in this stack" if spec.enabled else "off in this stack: what `serving.routing.enabled: true` runs"
    roots = [live.server_root(str(r.get("url", ""))) for r in replicas]
    metrics = [str(r.get("metrics_url", "")) for r in replicas]
    workdir = session.cluster.workdir
    report.sub(
        session.name,
        f"router ({state}): the rendered command and environment "
        f"({' '.join(f'{k}={v}' for k, v in spec.env.items())}), run as `python -m vllm_router.launch_router` "
        f"(the image's `vllm-router` script), discovery replaced by --worker-urls {' '.join(roots)}",
    )
    key, what = session.serve.api_key, f"routing ({model.model_id})"
    try:
        run = measure_split(
            spec.command, spec.env, spec.front, roots, metrics, key, model.model_id, workdir / "router.log"
        )
        split = run.split
        report.check(
            session.name,
            run.refused == 401,
            f"{what}: without an API key the router passes on the replica's {run.refused} (want 401)",
        )
        report.check(
            session.name,
            run.control == 404,
            f"{what}: the router's keyless control route (POST /remove_worker) through its front: {run.control} "
            "(want 404: the load balancer reaches only the API's routes)",
        )
        turns = split
        if split.policy != "round_robin":
            report.note(
                session.name,
                f"{what}: one keep-alive client at steady load through the stack's router ({split.policy}): "
                f"the replicas answered {split.counts} in {split.seconds:.0f}s (the replicas' speeds differ here)",
            )
            rr = with_policy(spec.command, "round_robin")
            rr_log = workdir / "router-rr.log"
            turns = measure_split(rr, spec.env, spec.front, roots, metrics, key, model.model_id, rr_log).split
    except Exception as err:
        report.fail(session.name, f"{what}: {type(err).__name__}: {err}")
        return
    ratio = imbalance(turns.counts)
    report.check(
        session.name,
        ratio <= MAX_IMBALANCE,
        f"{what}: one keep-alive client at steady load through the router (round_robin): the replicas answered "
        f"{turns.counts} in {turns.seconds:.0f}s, busiest over idlest {ratio:.2f} (want <= {MAX_IMBALANCE}; a "
        "network load balancer keeps each of the client's connections on one replica)",
    )
    if spec.gateway is not None:
        check_gateway(session, report, model, roots)


def _keys_file(serve: TwinServeConfig) -> str:
    """The twin's keys file, as the deployed config names it for the servers' guards."""
    for app in serve.config.get("applications", []):
        path = app.get("args", {}).get("args", {}).get("api_keys_file")
        if path:
            return str(path)
    raise RuntimeError("the deployed config names no api_keys_file")


def check_gateway(session: Session, report: Report, model: ModelInfo, roots: list[str]) -> None:
    """The model gateway in front of this model's router: routed by `model`, keyed first, the others held apart."""
    spec = session.router
    assert spec is not None and spec.gateway is not None
    what = f"gateway ({model.model_id})"
    report.sub(
        session.name,
        f"gateway (`serving.gateway`, {'on' if spec.enabled else 'off'} in this stack): the rendered settings, run as "
        "`python -m inference_server.gateway`; the twin runs one RayService at a time, so only this model's "
        "router is live and every other model's route points at a closed port",
    )
    try:
        run = measure_gateway(
            spec.gateway,
            _keys_file(session.serve),
            spec.command,
            spec.env,
            spec.front,
            roots,
            session.serve.api_key,
            model.model_id,
            session.cluster.workdir,
            lambda line: report.sub(session.name, line),
        )
    except Exception as err:
        report.fail(session.name, f"{what}: {type(err).__name__}: {err}")
        return
    report.check(
        session.name,
        run.streamed.status == 200 and run.chunks >= 1,
        f"{what}: a streamed chat naming {model.model_id}, through the gateway and its router: {run.streamed.status}, "
        f"{run.chunks} chunks with content (want 200 and at least one)",
    )
    report.check(
        session.name,
        run.listed == [model.model_id],
        f"{what}: /v1/models through the gateway lists {run.listed} (want [{model.model_id!r}]: the models "
        "whose routers answer)",
    )
    report.check(
        session.name,
        run.refused.status == 401,
        f"{what}: without an API key: {run.refused.status} (want 401, before the gateway says anything of the model)",
    )
    report.check(
        session.name,
        run.unknown.status == 404 and run.unknown.code() == "model_not_found",
        f"{what}: a model no service serves: {run.unknown.status} {run.unknown.code()} (want 404 model_not_found)",
    )
    for other, answer in sorted(run.absent.items()):
        report.check(
            session.name,
            answer.status == 503 and answer.retry_after is not None,
            f"{what}: {other}, whose router is not live in this session: {answer.status} Retry-After "
            f"{answer.retry_after} (want 503 with Retry-After, never another model's server)",
        )


def check_every_server_ready(
    session: Session, report: Report, sampler: live.ServerSampler, settle_s: float = 30.0
) -> None:
    """Every worker pod passes the rendered readiness probe: its replica's server answers /health."""
    not_ready: list[str] = []

    def all_ready() -> bool:
        not_ready[:] = [
            name for name, roots in sampler.servers().items() if not any(live.server_health(r) for r in roots)
        ]
        return not not_ready

    ok = live.wait_for(all_ready, settle_s)
    report.check(
        session.name,
        ok,
        "readiness: every worker node's vLLM server answers /health"
        if ok
        else f"readiness: {', '.join(not_ready)} never answer /health: those pods stay NotReady "
        "(a worker pod without a replica has no server)",
    )


def observed(session: Session, objects: list[dict[str, Any]], workdir: Path) -> observe.Observed:
    """What the observability run needs of the session: where requests go, which processes a fault kills."""
    servers = server_models(session)
    model = servers[0] if servers else session.serve.models[0]
    folders = [m.address_dir for m in servers if m.address_dir is not None]

    def replicas() -> list[dict[str, Any]]:
        return _replicas_of(model) if servers else []

    def base_urls() -> list[str]:
        if servers:
            return [str(r["url"]) for r in replicas()]
        ports = [n.proxy_port for n in session.cluster.nodes() if n.proxy_port and live.healthz(n.proxy_port)]
        return [f"http://127.0.0.1:{p}/v1" for p in ports]

    def server_pids() -> list[int]:
        if servers:
            return [int(r["pid"]) for r in replicas() if r.get("pid")]
        details = live.serve_details()
        return [
            int(r["pid"])
            for name, d in live.deployments(details, model.app).items()
            if live.is_model_deployment(name, model.model_id)
            for r in live.running_replicas(d)
            if r.get("pid")
        ]

    app = next(a for a in session.serve.config.get("applications") or [] if a.get("name") == model.app)
    catalog = Catalog.model_validate(app["args"]["args"])
    return observe.Observed(
        name=session.name,
        service=session.service,
        cluster=session.cluster,
        layouts={m.layout for m in session.serve.models},
        traffic=observe.Traffic(
            model_id=model.model_id,
            api_key=session.serve.api_key,
            base_urls=base_urls,
            server_pids=server_pids,
            client_keys=session.serve.client_keys,
            per_key_cap=catalog.fairness.max_inflight_per_key,
            replica_cap=catalog.replica_inflight_cap(),
        ),
        address_dirs=folders,
        head_ports=session.head_ports,
        workdir=workdir,
        objects=objects,
    )


def run_observability(
    session: Session, report: Report, objects: list[dict[str, Any]], workdir: Path, *, faults: bool
) -> None:
    """A real Prometheus on the live session (twin.observe); skipped with a FAIL when it is not installed."""
    from twin.prometheus import PrometheusMissingError

    report.step(session.name, "monitoring: Prometheus with the render's monitors and rules")
    try:
        observe.run(observed(session, objects, workdir), report, faults=faults)
    except PrometheusMissingError as err:
        report.fail(session.name, f"monitoring: {err}")
