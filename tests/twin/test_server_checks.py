"""The twin's static checks of the vllm-server layout (twin/checks.py) on the committed renders.

Both committed stacks render vllm-server (prod: one model per service,
min_replicas >= 1; dev: its one model at zero, routed and woken by the
gateway): there the replica is one actor, whose resources come from the
workload's own builder, and the load balancer (or the model's router)
reaches the replica's vLLM server in its pod. Each test breaks one thing
in prod's render the way a config or a code change could, and the check
must fail naming it.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import yaml

from tests.harness import SERVE_INGRESS, group, ray_services
from twin import checks
from twin.render import RayServiceSpec
from twin.report import Report

pytestmark = pytest.mark.usefixtures("needs_ray")

# The prod service whose model takes a whole 4-GPU node (tensor parallel 4).
BIG = 1


def raw_service(index: int = 0) -> dict[str, Any]:
    raw: dict[str, Any] = copy.deepcopy(ray_services("prod")[index])
    return raw


def spec_of(raw: dict[str, Any]) -> RayServiceSpec:
    return RayServiceSpec(raw["metadata"]["name"], raw["metadata"]["namespace"], raw["metadata"], raw["spec"])


def gpu_group(raw: dict[str, Any]) -> dict[str, Any]:
    return group(raw, f"gpu-{raw['metadata']['name']}")


def edit_catalog(raw: dict[str, Any], **model_fields: Any) -> None:
    serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["models"][0].update(model_fields)
    raw["spec"]["serveConfigV2"] = yaml.safe_dump(serve)


def container(spec: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = spec["template"]["spec"]["containers"][0]
    return found


def lines(check: Any, spec: RayServiceSpec, *args: Any) -> str:
    out = io.StringIO()
    check(spec, Report(out=out), *args)
    return out.getvalue()


def placement_lines(spec: RayServiceSpec) -> str:
    config, _ = run_quiet(checks.derive_autoscaling_config, spec, {})
    return lines(checks.check_placements, spec, config, checks.model_groups_for(spec, None))


def run_quiet(check: Any, *args: Any) -> tuple[Any, str]:
    out = io.StringIO()
    result = check(args[0], Report(out=out), *args[1:])
    return result, out.getvalue()


def port_lines(spec: RayServiceSpec) -> str:
    return lines(checks.check_server_ports, spec, checks.model_groups_for(spec, None))


def test_the_committed_stacks_render_the_vllm_server_layout() -> None:
    for stack in ("dev", "prod"):
        for raw in ray_services(stack):
            serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
            assert [checks.catalog_layout(a["args"]) for a in serve["applications"]] == ["vllm-server"], stack


def test_the_replica_options_are_the_builders() -> None:
    serve = spec_of(raw_service(BIG)).serve_config()
    replica = checks.vllm_server_replica(serve["applications"][0])
    assert replica.actor_options == {"num_cpus": 1, "num_gpus": 4, "accelerator_type": "L40S"}
    assert replica.resources == {"CPU": 1.0, "GPU": 4.0, "accelerator_type:L40S": 0.001}
    assert replica.placement_group_bundles is None and replica.min_replicas == 2


def test_the_committed_replicas_fit_only_their_group_once() -> None:
    for stack in ("dev", "prod"):
        for raw in ray_services(stack):
            out = placement_lines(spec_of(copy.deepcopy(raw)))
            assert out.startswith("PASS") and "once, and no other group" in out, out


def with_cpu_group(raw: dict[str, Any]) -> None:
    """A CPU-only worker group on nodes of its own (say, for batch work)."""
    extra = copy.deepcopy(gpu_group(raw))
    extra["groupName"] = "cpu-extra"
    extra["resources"] = {}
    pod = extra["template"]["spec"]
    pod["nodeSelector"] = {"pool": "cpu"}
    pod.pop("affinity", None)
    pod.pop("tolerations", None)
    limits = container(extra).setdefault("resources", {})
    for kind in ("limits", "requests"):
        limits[kind] = {"cpu": "8", "memory": "16Gi"}
    raw["spec"]["rayClusterConfig"]["workerGroupSpecs"].append(extra)


def test_a_replica_that_fits_a_cpu_only_group_fails() -> None:
    """Without an accelerator the replica asks for one CPU, which any CPU worker has: vLLM would land there."""
    raw = raw_service()
    with_cpu_group(raw)
    edit_catalog(raw, accelerator_type=None)
    out = placement_lines(spec_of(raw))
    assert out.startswith("FAIL") and "also fits group cpu-extra" in out, out
    assert "vLLM would run on the CPU" in out


def test_the_committed_replica_does_not_fit_a_cpu_only_group() -> None:
    raw = raw_service()
    with_cpu_group(raw)
    out = placement_lines(spec_of(raw))
    assert out.startswith("PASS"), out


def test_two_replicas_in_one_pod_fail() -> None:
    """Tensor parallel 2 on a 4-GPU node: two replicas share the pod, and its one server port."""
    raw = raw_service(BIG)
    edit_catalog(raw, tensor_parallel_size=2)
    out = placement_lines(spec_of(raw))
    assert out.startswith("FAIL") and "two replicas" in out and "share the pod's port" in out, out


def test_a_mistyped_accelerator_fails() -> None:
    raw = raw_service()
    edit_catalog(raw, accelerator_type="H100")
    out = placement_lines(spec_of(raw))
    assert out.startswith("FAIL") and "accelerator_type:H100 0.001 > 0" in out, out


def test_actor_options_from_the_serve_config_count() -> None:
    raw = raw_service()
    serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
    name = checks.vllm_server_replica(serve["applications"][0]).deployment
    serve["applications"][0]["deployments"] = [{"name": name, "ray_actor_options": {"num_gpus": 0}}]
    raw["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    out = placement_lines(spec_of(raw))
    assert out.startswith("FAIL") and "asks for 0 GPUs" in out, out


def test_the_committed_server_ports_pass() -> None:
    for stack in ("dev", "prod"):
        for raw in ray_services(stack):
            out = port_lines(spec_of(copy.deepcopy(raw)))
            assert out.startswith("PASS") and "probe GET /health on openai (8100)" in out, out


def test_a_probe_on_a_port_the_container_does_not_declare_fails() -> None:
    raw = raw_service()
    container(gpu_group(raw))["readinessProbe"]["httpGet"]["port"] = "vllm"
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "port 'vllm' is not among the container's ports" in out, out


def test_a_probe_on_the_metrics_port_fails() -> None:
    raw = raw_service()
    container(gpu_group(raw))["readinessProbe"]["httpGet"]["port"] = "vllm-metrics"
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "checks port 8101 but the server listens on 8100" in out, out


def test_a_pod_without_its_own_probe_fails() -> None:
    raw = raw_service()
    container(gpu_group(raw)).pop("readinessProbe")
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "no HTTP readiness probe" in out, out


def test_a_server_port_other_than_the_catalogues_fails() -> None:
    raw = raw_service()
    serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["vllm_server"]["port"] = 9000
    raw["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "the server listens on 9000" in out, out
    assert "declares no port 9000" in out


def test_a_serve_service_on_serves_proxy_fails() -> None:
    raw = raw_service()
    raw["spec"]["serveService"]["spec"]["ports"][0]["targetPort"] = "serve"
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "targetPort 'serve' is not the server's port 8100" in out, out


def test_a_serve_port_on_the_head_fails() -> None:
    """KubeRay gives the serve Service the head's `serve` ports when the head declares any."""
    raw = raw_service()
    head = container(raw["spec"]["rayClusterConfig"]["headGroupSpec"])
    head["ports"].append({"name": "serve", "containerPort": 8000, "protocol": "TCP"})
    out = port_lines(spec_of(raw))
    assert out.startswith("FAIL") and "the head declares ['serve']" in out, out


def test_the_serve_ingress_layout_has_no_server_port_check() -> None:
    raw = copy.deepcopy(ray_services(SERVE_INGRESS)[0])
    spec = spec_of(raw)
    assert port_lines(spec) == ""


def test_a_model_the_gateway_wakes_passes_the_static_checks_and_gets_the_wake_checks() -> None:
    """Dev with routing and the gateway: its model at zero in the vllm-server layout (tests/test_serving_wake.py)."""
    from types import SimpleNamespace

    from tests.harness import manifests_of, render_routed
    from twin.deploy import ModelInfo
    from twin.run import check_woken, woken_models

    (raw,) = manifests_of(render_routed("dev"), "RayService")
    spec = spec_of(copy.deepcopy(raw))
    out = io.StringIO()
    report = Report(out=out)
    assert checks.run_static_checks(spec, report, None) is not None
    assert report.failed == [], out.getvalue()
    assert "server port" in out.getvalue()

    woken = ModelInfo(app="a", model_id="m", min_replicas=0, accelerator_type=None, layout="vllm-server")
    models = [
        woken,
        ModelInfo(app="b", model_id="n", min_replicas=1, accelerator_type=None, layout="vllm-server"),
        ModelInfo(app="c", model_id="o", min_replicas=0, accelerator_type=None, layout="serve-ingress"),
    ]
    session = SimpleNamespace(name=spec.name, serve=SimpleNamespace(models=models), router=None, model_groups={})
    assert woken_models(session) == [woken]  # type: ignore[arg-type]
    # Without the gateway's settings in the session there is nothing to wake it with: said, as a failure.
    out = io.StringIO()
    report = Report(out=out)
    check_woken(session, report, woken)  # type: ignore[arg-type]
    assert report.failed == ["[" + spec.name + "] wake (m): the render runs no gateway that wakes this model"]
