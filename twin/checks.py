"""What Ray's own code makes of a rendered RayService, before anything runs.

1. Every group's ``ray start`` line, built as KubeRay 1.7 builds it
   (:mod:`twin.kuberay`), split into words by a real ``bash -c`` and parsed
   by Ray's own click command (``ray.scripts.scripts.start``), then its
   ``--resources``/``--labels`` values by the functions ``ray start`` calls
   and Ray's own ``RayParams`` checks. Nothing is started.
2. The autoscaling config, derived from the custom resource by Ray's own
   KubeRay conversion (``_derive_autoscaling_config_from_ray_cr``), one group
   at a time so an error names its group; and the resources the autoscaler
   believes a node has must be the ones ``ray start`` gives it.
3. Every model's placement-group bundles, computed by Ray Serve LLM's own
   ``LLMServer.get_deployment_options`` from the rendered catalogue, must fit
   one node of the model's own worker group and no other group.
4. The OpenAI ingress replica's resources, from Serve LLM's own builder on
   the rendered catalogue, must fit a CPU group and no GPU group (nor the
   head when the serve Service leaves it out): an ingress replica on a GPU
   worker leaves an ingress pod with no proxy, never Ready.

A catalogue in the "vllm-server" layout has neither a placement group nor an
ingress: Serve places one actor per replica, which runs vLLM's own server,
and the load balancer reaches that server in the pod. For it, 3 and 4 become:

3. The replica actor's resources, from the workload's own builder on the
   rendered catalogue, must fit one node of the model's group, no other
   group, and never twice in one node (two servers in one pod would race
   for its port).
4. The model's GPU pods must declare the server's port, probe its /health
   for readiness on it, and the serve Service must send traffic to it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

from twin import kuberay
from twin.render import RayServiceSpec
from twin.report import Report

BASH_TIMEOUT_S = 10.0
# The Ray resources a bundle can ask for that are not custom resources.
_NOT_CUSTOM = ("CPU", "GPU", "memory", "object_store_memory")


class StartCommandError(ValueError):
    """``ray start`` would stop on this command line; the message is Ray's own."""


@dataclass(frozen=True)
class ParsedStart:
    """The node resources a ``ray start`` command line gives its node, as Ray parsed them."""

    argv: list[str]
    params: dict[str, Any]
    resources: dict[str, float]

    def node_resources(self) -> dict[str, float]:
        """CPU, GPU, memory and custom resources, where the command sets them."""
        result: dict[str, float] = {}
        for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
            if self.params.get(key) is not None:
                result[name] = float(self.params[key])
        result.update(self.resources)
        return result


def bash_words(command: str) -> list[str]:
    """The argv that ``bash -c`` hands to ``ray`` for ``command``: bash does the word splitting.

    ``ray`` is replaced by a shell function that prints its arguments
    NUL-separated. The script runs in an empty directory with a minimal
    environment (globs expand as they would in a fresh pod's working dir).
    """
    script = "ray() { printf '%s\\0' \"$@\"; }\n" + command
    with tempfile.TemporaryDirectory(prefix="twin-bash-") as empty:
        done = subprocess.run(
            ["bash", "-c", "--", script],
            cwd=empty,
            env={"PATH": "/usr/bin:/bin", "HOME": empty},
            capture_output=True,
            timeout=BASH_TIMEOUT_S,
            check=False,
        )
    words = done.stdout.decode(errors="replace").split("\0")
    return words[:-1] if words and words[-1] == "" else words


def parse_ray_start(argv: list[str]) -> ParsedStart:
    """Parses ``ray <argv>`` with Ray's own ``ray start`` command and the parsing ``ray start`` does first.

    Raises :class:`StartCommandError` with Ray's message where ``ray start`` would stop.
    """
    import click

    # The very functions `ray start` calls (ray/scripts/scripts.py imports them from these modules).
    from ray._private.label_utils import parse_node_labels_string
    from ray._private.parameter import RayParams
    from ray._private.utils import parse_resources_json
    from ray.autoscaler._private.cli_logger import cf, cli_logger
    from ray.scripts.scripts import start

    if not argv or argv[0] != "start":
        raise StartCommandError(f"bash did not call `ray start` (got {argv[:2]})")
    try:
        context = start.make_context("ray start", list(argv[1:]))
    except click.ClickException as err:
        raise StartCommandError(f"UsageError: {err.format_message()}") from None
    params = dict(context.params)
    # ray start's own cli_logger prints its complaint before it aborts: keep it out of the report.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            resources = parse_resources_json(params.get("resources") or "{}", cli_logger, cf)
        except click.ClickException:
            raise StartCommandError(
                f"--resources={params.get('resources')} is not a valid JSON object (ray start aborts)"
            ) from None
    try:
        labels = parse_node_labels_string(params.get("labels") or "")
    except ValueError as err:
        raise StartCommandError(f"--labels={params.get('labels')}: {err}") from None
    try:
        RayParams(
            num_cpus=params.get("num_cpus"),
            num_gpus=params.get("num_gpus"),
            memory=params.get("memory"),
            object_store_memory=params.get("object_store_memory"),
            resources=resources,
            labels=labels,
        )
    except (AssertionError, ValueError) as err:
        raise StartCommandError(str(err)) from None
    return ParsedStart(argv=argv, params=params, resources={str(k): float(v) for k, v in resources.items()})


def check_start_commands(service: RayServiceSpec, report: Report) -> dict[str, ParsedStart]:
    """Check 1 for every group; returns what parsed, by group name."""
    cluster = service.cluster
    in_tree = bool(cluster.get("enableInTreeAutoscaling", False))
    head_address = kuberay.head_service_address(service.name, service.namespace)
    parsed: dict[str, ParsedStart] = {}
    for group in kuberay.groups(cluster):
        try:
            command = kuberay.build_start_command(group, head_address=head_address, in_tree_autoscaling=in_tree)
            words = bash_words(command.container_command)
            parsed[group.name] = parse_ray_start(words)
        except kuberay.KubeRayValidationError as err:
            report.fail(service.name, f"ray start ({group.name}): KubeRay rejects the group: {err}")
        except StartCommandError as err:
            report.fail(service.name, f"ray start ({group.name}): {err} -- from `{command.ray_start.strip()}`")
        else:
            report.ok(service.name, f"ray start ({group.name}): Ray parses `{command.ray_start.strip()}`")
    return parsed


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def derive_autoscaling_config(
    service: RayServiceSpec, report: Report, started: Mapping[str, ParsedStart]
) -> dict[str, Any] | None:
    """Check 2: Ray's KubeRay conversion, group by group, then whole; None when it fails."""
    from ray.autoscaler._private.kuberay import autoscaling_config as kuberay_conversion

    cluster = service.cluster
    specs = [(kuberay.HEAD_GROUP, cluster.get("headGroupSpec") or {}, True)]
    specs += [(str(g.get("groupName")), g, False) for g in service.worker_groups()]
    ok = True
    with _quiet(kuberay_conversion.__name__):
        for name, spec, is_head in specs:
            try:
                node_type = kuberay_conversion._node_type_from_group_spec(spec, is_head=is_head)
            except Exception as err:
                ok = report.check(service.name, False, f"autoscaling config ({name}): {type(err).__name__}: {err}")
                continue
            ok &= _check_node_type(service, report, name, node_type, started.get(name))
        if not ok:
            return None
        try:
            config: dict[str, Any] = kuberay_conversion._derive_autoscaling_config_from_ray_cr(service.ray_cr)
        except Exception as err:
            report.fail(service.name, f"autoscaling config: {type(err).__name__}: {err}")
            return None
    report.ok(
        service.name,
        "autoscaling config: Ray's KubeRay conversion gives "
        + ", ".join(
            f"{name} {t['min_workers']}..{t['max_workers']} {_fmt(t['resources'])}"
            for name, t in config["available_node_types"].items()
        )
        + f"; idle timeout {config['idle_timeout_minutes'] * 60:.0f}s",
    )
    return config


def _check_node_type(
    service: RayServiceSpec, report: Report, name: str, node_type: Mapping[str, Any], started: ParsedStart | None
) -> bool:
    """The autoscaler's idea of the node must be what ``ray start`` makes of it."""
    if started is None:
        return True  # the start command already failed and was reported
    believed = {k: float(v) for k, v in node_type["resources"].items()}
    actual = started.node_resources()
    wrong = [
        f"{key}: autoscaler {_num(believed.get(key))}, ray start {_num(actual.get(key))}"
        for key in sorted(set(believed) | set(actual))
        if key in actual and believed.get(key) != actual[key]
    ]
    return report.check(
        service.name,
        not wrong,
        f"node resources ({name}): "
        + (
            "; ".join(wrong) + " -- the autoscaler would plan with resources the node does not have"
            if wrong
            else f"the autoscaler and ray start agree on {_fmt(actual)}"
        ),
    )


def _num(value: float | None) -> str:
    if value is None:
        return "none"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _fmt(resources: Mapping[str, float]) -> str:
    def show(key: str, value: float) -> str:
        if key in ("memory", "object_store_memory") and value >= 2**30:
            return f"{key} {value / 2**30:g}Gi"
        return f"{key} {_num(value)}"

    return "{" + ", ".join(show(k, float(v)) for k, v in resources.items()) + "}"


@contextlib.contextmanager
def no_local_ray_instance() -> Iterator[None]:
    """Lets Serve LLM compute deployment options without a Ray cluster.

    ``LLMServer.get_deployment_options`` copies the driver's runtime_env into
    the replica options through ``ray.get_runtime_context()``, which starts a
    local Ray instance when none is connected. The bundles do not depend on
    it, so it sees an empty one here.
    """
    import ray

    with mock.patch.object(
        ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env={}, get_job_id=lambda: None)
    ):
        yield


@dataclass(frozen=True)
class ModelPlacement:
    """One model's replica placement as Ray Serve LLM computes it."""

    model_id: str
    bundles: list[dict[str, float]]
    strategy: str


def serve_llm_placements(catalog_args: Mapping[str, Any]) -> list[ModelPlacement]:
    """Every model's placement-group bundles, from the catalogue, with the workload's and Serve LLM's own code.

    The LLMConfig comes from the workload (``inference_server.app.llm_configs``,
    i.e. ``engine.llm_config_kwargs``); the bundles and strategy from Serve
    LLM's ``LLMServer.get_deployment_options``, which on the GPU path asks no
    CUDA: it merges the replica actor's resources into the accelerator
    backend's default bundles (``GPUConfig``: one ``{GPU: 1,
    accelerator_type:<T>: 0.001}`` per device).
    """
    # The workload's own package, as the image imports it (workloads/ on the path); untyped here.
    server: Any = importlib.import_module("inference_server.app")
    catalog = importlib.import_module("inference_server.catalog").Catalog.model_validate(dict(catalog_args))
    placements = []
    with no_local_ray_instance():
        for config in server.llm_configs(catalog):
            options = server.LLMServer.get_deployment_options(config)
            placements.append(
                ModelPlacement(
                    model_id=config.model_id,
                    bundles=[{str(k): float(v) for k, v in b.items()} for b in options["placement_group_bundles"]],
                    strategy=str(options.get("placement_group_strategy", "PACK")),
                )
            )
    return placements


def shortfall(bundle: Mapping[str, float], node: Mapping[str, float]) -> list[str]:
    """What ``node`` lacks to hold ``bundle`` (empty when it fits)."""
    return [
        f"{key} {_num(need)} > {_num(node.get(key, 0.0))}"
        for key, need in sorted(bundle.items())
        if need > 0 and node.get(key, 0.0) < need
    ]


def total(bundles: list[dict[str, float]]) -> dict[str, float]:
    """The sum of a replica's bundles."""
    result: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            result[key] = result.get(key, 0.0) + value
    return result


def _node_group(spec: Mapping[str, Any]) -> Any:
    """What decides which Kubernetes nodes a group's pods land on."""
    pod = (spec.get("template") or {}).get("spec") or {}
    return (pod.get("nodeSelector") or {}, pod.get("affinity") or {})


def check_placements(
    service: RayServiceSpec, report: Report, config: Mapping[str, Any], model_groups: Mapping[str, str]
) -> None:
    """Check 3: each model's bundles fit its own group's node, and no other group unless they share nodes."""
    node_types: dict[str, dict[str, float]] = {
        name: {k: float(v) for k, v in t["resources"].items()} for name, t in config["available_node_types"].items()
    }
    specs = {str(g.get("groupName")): g for g in service.worker_groups()}
    serve_config = service.serve_config()
    for app in serve_config.get("applications") or []:
        if catalog_layout(app.get("args") or {}) == "vllm-server":
            try:
                replica = vllm_server_replica(app)
            except Exception as err:
                report.fail(service.name, f"replica placement ({app.get('name')}): the builder refuses it: {err}")
                continue
            check_replica_placement(service, report, replica, node_types, specs, model_groups)
            continue
        try:
            placements = serve_llm_placements(app.get("args") or {})
        except Exception as err:
            report.fail(service.name, f"placement ({app.get('name')}): Serve LLM refuses the catalogue: {err}")
            continue
        for placement in placements:
            _check_placement(service, report, placement, node_types, specs, model_groups)


def _check_placement(
    service: RayServiceSpec,
    report: Report,
    placement: ModelPlacement,
    node_types: Mapping[str, dict[str, float]],
    specs: Mapping[str, Mapping[str, Any]],
    model_groups: Mapping[str, str],
) -> None:
    label = f"placement ({placement.model_id})"
    shown = ", ".join(_fmt(b) for b in placement.bundles)
    group = model_groups.get(placement.model_id)
    if group is None or group not in node_types:
        report.fail(service.name, f"{label}: no worker group {group or '?'} for the model in the RayCluster")
        return
    own = node_types[group]
    problems = []
    for bundle in placement.bundles:
        short = shortfall(bundle, own)
        if short:
            problems.append(f"bundle {_fmt(bundle)} does not fit a node of {group} {_fmt(own)} ({'; '.join(short)})")
    hosts = int((specs.get(group) or {}).get("numOfHosts", 1))
    whole = total(placement.bundles)
    if not problems and hosts == 1 and shortfall(whole, own):
        problems.append(f"the replica's bundles together {_fmt(whole)} do not fit one node of {group} {_fmt(own)}")
    if own.get("GPU", 0) > 0 and whole.get("GPU", 0) <= 0:
        problems.append(f"the replica asks for no GPU but {group} has {_num(own['GPU'])}: vLLM would run on the CPU")
    shared = _node_group(specs.get(group) or {})
    for other, resources in sorted(node_types.items()):
        if other == group or (other in specs and _node_group(specs[other]) == shared):
            continue
        if all(not shortfall(bundle, resources) for bundle in placement.bundles):
            problems.append(f"its bundles also fit group {other} {_fmt(resources)}: the replica could land there")
    report.check(
        service.name,
        not problems,
        f"{label}: "
        + (
            "; ".join(problems)
            if problems
            else f"Serve LLM's bundles [{shown}] ({placement.strategy}) fit one node of {group} and no other group"
        ),
    )


def catalog_layout(catalog_args: Mapping[str, Any]) -> str:
    """The catalogue's layout ("serve-ingress" when it names none, as the catalogue's own default)."""
    return str(catalog_args.get("layout") or "serve-ingress")


def parse_catalog(catalog_args: Mapping[str, Any]) -> Any:
    """The workload's own ``Catalog`` of ``catalog_args`` (untyped here: the workload is not on mypy's path)."""
    return importlib.import_module("inference_server.catalog").Catalog.model_validate(dict(catalog_args))


@dataclass(frozen=True)
class ReplicaOptions:
    """What one replica of a "vllm-server" deployment asks Ray for, as the workload's builder sets it."""

    model_id: str
    deployment: str
    actor_options: dict[str, Any]
    resources: dict[str, float]
    placement_group_bundles: list[dict[str, float]] | None
    max_replicas_per_node: int | None
    min_replicas: int


# The actor options that decide where a replica lands (the rest, such as runtime_env, do not).
PLACEMENT_OPTIONS = ("num_cpus", "num_gpus", "memory", "accelerator_type", "resources")


def _config_overrides(app: Mapping[str, Any], deployment: str) -> dict[str, Any]:
    """The serveConfigV2 ``deployments`` entry for ``deployment``: Serve applies it over the builder's options."""
    for entry in app.get("deployments") or []:
        if isinstance(entry, dict) and entry.get("name") == deployment:
            return dict(entry)
    return {}


def vllm_server_replica(app: Mapping[str, Any]) -> ReplicaOptions:
    """The replica actor of a "vllm-server" application, from the workload's ``build_app`` on its catalogue."""
    from ray.serve._private.config import ReplicaConfig

    catalog_args = dict(app.get("args") or {})
    server: Any = importlib.import_module("inference_server.app")
    with no_local_ray_instance(), _quiet("ray.serve"), _quiet("inference_server"):
        deployment = server.build_app(catalog_args)._bound_deployment
    replica = deployment._replica_config
    overrides = _config_overrides(app, deployment.name)
    if overrides:
        # As Serve applies a config entry: its ray_actor_options replace the code's, the rest override one by one.
        replica = ReplicaConfig.create(
            replica.deployment_def,
            ray_actor_options=dict(overrides.get("ray_actor_options", replica.ray_actor_options) or {}),
            placement_group_bundles=overrides.get("placement_group_bundles", replica.placement_group_bundles),
            max_replicas_per_node=overrides.get("max_replicas_per_node", replica.max_replicas_per_node),
        )
    options = dict(replica.ray_actor_options or {})
    entry = parse_catalog(catalog_args).models[0]
    bundles = replica.placement_group_bundles
    return ReplicaOptions(
        model_id=str(entry.model_id),
        deployment=str(deployment.name),
        actor_options={k: v for k, v in options.items() if k in PLACEMENT_OPTIONS},
        resources={str(k): float(v) for k, v in replica.resource_dict.items() if v},
        placement_group_bundles=None
        if bundles is None
        else [{str(k): float(v) for k, v in b.items()} for b in bundles],
        max_replicas_per_node=replica.max_replicas_per_node,
        min_replicas=int(entry.autoscaling.min_replicas),
    )


def scaled(resources: Mapping[str, float], times: int) -> dict[str, float]:
    """``times`` replicas' worth of ``resources``."""
    return {key: value * times for key, value in resources.items()}


def check_replica_placement(
    service: RayServiceSpec,
    report: Report,
    replica: ReplicaOptions,
    node_types: Mapping[str, dict[str, float]],
    specs: Mapping[str, Mapping[str, Any]],
    model_groups: Mapping[str, str],
) -> None:
    """Check 3 for "vllm-server": the replica actor fits one node of the model's group, once, and no other group."""
    label = f"replica placement ({replica.model_id})"
    need = replica.resources
    group = model_groups.get(replica.model_id)
    if group is None or group not in node_types:
        report.fail(service.name, f"{label}: no worker group {group or '?'} for the model in the RayCluster")
        return
    own = node_types[group]
    problems = []
    if replica.placement_group_bundles:
        problems.append(
            f"the replica asks for a placement group {replica.placement_group_bundles}: the layout runs one actor"
        )
    short = shortfall(need, own)
    if short:
        problems.append(f"a replica {_fmt(need)} does not fit a node of {group} {_fmt(own)} ({'; '.join(short)})")
    elif not shortfall(scaled(need, 2), own) and replica.max_replicas_per_node != 1:
        problems.append(
            f"two replicas {_fmt(need)} fit one node of {group} {_fmt(own)}: their servers would share the pod's port"
        )
    if own.get("GPU", 0) > 0 and need.get("GPU", 0) < own["GPU"]:
        problems.append(
            f"the replica asks for {_num(need.get('GPU', 0))} GPUs but a node of {group} has {_num(own['GPU'])}"
            + (": vLLM would run on the CPU" if need.get("GPU", 0) <= 0 else ": the rest would sit idle")
        )
    shared = _node_group(specs.get(group) or {})
    for other, resources in sorted(node_types.items()):
        if other == group or (other in specs and _node_group(specs[other]) == shared):
            continue
        if not shortfall(need, resources):
            problems.append(f"it also fits group {other} {_fmt(resources)}: the replica could land there")
    report.check(
        service.name,
        not problems,
        f"{label}: "
        + (
            "; ".join(problems)
            if problems
            else f"the {replica.deployment} replica {_fmt(need)} fits one node of {group}, once, and no other group"
        ),
    )


def _container(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The Ray container of a group (KubeRay's is the first)."""
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    return dict(containers[0])


def resolve_port(port: Any, declared: Mapping[str, int]) -> int | None:
    """A probe's or a Service's port (a name or a number) as the container port it means, or None."""
    if isinstance(port, str) and not port.isdigit():
        return declared.get(port)
    try:
        number = int(port)
    except (TypeError, ValueError):
        return None
    return number if number in declared.values() else None


def check_server_pods(service: RayServiceSpec, report: Report, catalog: Any, group: str | None, model_id: str) -> None:
    """Check 4 for "vllm-server": the GPU pods declare and probe the server's port; the serve Service targets it."""
    label = f"server port ({model_id})"
    specs = {str(g.get("groupName")): g for g in service.worker_groups()}
    if group is None or group not in specs:
        report.fail(service.name, f"{label}: no worker group {group or '?'} for the model in the RayCluster")
        return
    container = _container(specs[group])
    declared = {str(p.get("name")): int(p.get("containerPort", 0)) for p in container.get("ports") or []}
    want, metrics = int(catalog.vllm_server.port), int(catalog.vllm_server.metrics_port)
    problems = []
    probe = container.get("readinessProbe") or {}
    http = probe.get("httpGet") or {}
    probed = resolve_port(http.get("port"), declared)
    if not http:
        problems.append(
            f"the {group} pods have no HTTP readiness probe: KubeRay then injects Serve's proxy check, "
            "which says nothing of the vLLM server"
        )
    elif probed is None:
        problems.append(
            f"the readiness probe's port {http.get('port')!r} is not among the container's ports "
            f"{sorted(declared.items())}"
        )
    elif probed != want:
        problems.append(f"the readiness probe checks port {probed} but the server listens on {want}")
    if http and http.get("path") != "/health":
        problems.append(f"the readiness probe asks {http.get('path')!r}, not the server's open /health")
    if want not in declared.values():
        problems.append(f"the container declares no port {want} (vllm_server.port)")
    if metrics not in declared.values():
        problems.append(f"the container declares no port {metrics} (vllm_server.metrics_port): nothing scrapes it")
    head_ports = {str(p.get("name")) for p in _container(service.cluster.get("headGroupSpec") or {}).get("ports") or []}
    hijack = sorted(n for n in head_ports if n == "serve" or n.startswith("serve-"))
    if hijack:
        problems.append(
            f"the head declares {hijack}: KubeRay then gives the serve Service those ports instead of its own"
        )
    targets = [
        p.get("targetPort") for p in ((service.spec.get("serveService") or {}).get("spec") or {}).get("ports") or []
    ]
    if not targets:
        problems.append("the serve Service declares no ports: KubeRay's default targets Serve's proxy (serve, 8000)")
    for target in targets:
        if resolve_port(target, declared) != want:
            problems.append(f"the serve Service's targetPort {target!r} is not the server's port {want}")
    served = next((n for n, number in declared.items() if number == want), str(want))
    report.check(
        service.name,
        not problems,
        f"{label}: "
        + (
            "; ".join(problems)
            if problems
            else f"the {group} pods probe GET /health on {served} ({want}) and the serve Service targets it"
        ),
    )


def serve_llm_ingress_resources(catalog_args: Mapping[str, Any]) -> dict[str, float]:
    """The resources one OpenAI ingress replica asks for, from the workload's builder (Serve LLM's own options)."""
    server: Any = importlib.import_module("inference_server.app")
    with no_local_ray_instance(), _quiet("ray.serve"):
        ingress = server.build_app(dict(catalog_args))._bound_deployment
    return {str(k): float(v) for k, v in ingress._replica_config.resource_dict.items() if v}


def check_ingress_placement(service: RayServiceSpec, report: Report, config: Mapping[str, Any]) -> None:
    """Check 4: an ingress replica fits a CPU group's node and never a GPU group's (nor an excluded head)."""
    head = str(config.get("head_node_type"))
    fits: list[str] = []
    wrong: list[str] = []
    for app in service.serve_config().get("applications") or []:
        if catalog_layout(app.get("args") or {}) == "vllm-server":
            continue  # no ingress: the load balancer reaches the replicas' servers
        try:
            need = serve_llm_ingress_resources(app.get("args") or {})
        except Exception as err:
            report.fail(service.name, f"ingress placement ({app.get('name')}): Serve LLM refuses the catalogue: {err}")
            continue
        for name, node in sorted(config["available_node_types"].items()):
            resources = {k: float(v) for k, v in node["resources"].items()}
            if shortfall(need, resources):
                continue
            unwanted = resources.get("GPU", 0) > 0 or (name == head and service.excludes_head)
            (wrong if unwanted else fits).append(name)
        ok = bool(fits) and not wrong
        detail = f"fits {', '.join(fits) or 'no group'}" + (f"; also fits {', '.join(wrong)}" if wrong else "")
        report.check(service.name, ok, f"ingress placement ({app.get('name')}): a replica {_fmt(need)} {detail}")


def model_groups_by_order(service: RayServiceSpec, model_ids: list[str], gpu_prefix: str = "gpu-") -> dict[str, str]:
    """Fallback when the stack's model names are unknown: the GPU groups in the catalogue's order."""
    gpu_groups = [
        str(g.get("groupName")) for g in service.worker_groups() if str(g.get("groupName")).startswith(gpu_prefix)
    ]
    return dict(zip(model_ids, gpu_groups, strict=False))


def model_groups_for(service: RayServiceSpec, model_names: Mapping[str, str] | None) -> dict[str, str]:
    """model_id -> the worker group meant to hold it: ``gpu-<model name>``
    (infra.serving.ray_service.worker_group_name), or the GPU groups in catalogue order
    when the stack's model names are not known."""
    model_ids = [
        str(m.get("model_id"))
        for app in service.serve_config().get("applications") or []
        for m in ((app.get("args") or {}).get("models") or [])
    ]
    if model_names is None:
        return model_groups_by_order(service, model_ids)
    return {mid: f"gpu-{model_names[mid]}" for mid in model_ids if mid in model_names}


def run_static_checks(
    service: RayServiceSpec, report: Report, model_names: Mapping[str, str] | None
) -> tuple[dict[str, Any], dict[str, ParsedStart]] | None:
    """Checks 1-4 for one RayService; the autoscaling config and parsed start commands, or None if Ray
    could not start the RayService as rendered."""
    started = check_start_commands(service, report)
    config = derive_autoscaling_config(service, report, started)
    if config is None or len(started) != len(kuberay.groups(service.cluster)):
        return None
    groups = model_groups_for(service, model_names)
    check_placements(service, report, config, groups)
    check_ingress_placement(service, report, config)
    check_server_ports(service, report, groups)
    return config, started


def check_server_ports(service: RayServiceSpec, report: Report, model_groups: Mapping[str, str]) -> None:
    """Check 4 of every "vllm-server" application."""
    for app in service.serve_config().get("applications") or []:
        args = app.get("args") or {}
        if catalog_layout(args) != "vllm-server":
            continue
        try:
            catalog = parse_catalog(args)
        except Exception as err:
            report.fail(service.name, f"server port ({app.get('name')}): the catalogue does not parse: {err}")
            continue
        model_id = str(catalog.models[0].model_id)
        check_server_pods(service, report, catalog, model_groups.get(model_id), model_id)
