"""The twin's static checks with Ray's own parser, KubeRay conversion and Serve LLM bundles (twin/checks.py).

Each test shows a form that Ray rejects failing, with a line that names the
RayService and the group, and the committed form passing: dev's (vllm-server)
and that of dev's file on Serve's OpenAI ingress (SERVE_INGRESS).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import yaml

from tests.harness import SERVE_INGRESS, group, ray_services
from twin import checks, kuberay
from twin.render import RayServiceSpec
from twin.report import Report

pytestmark = pytest.mark.usefixtures("needs_ray")

BROKEN_RESOURCES = '{"accelerator_type:L4": 1}'


def service(stack: str = "dev", index: int = 0) -> tuple[RayServiceSpec, dict[str, Any]]:
    raw = copy.deepcopy(ray_services(stack)[index])
    spec = RayServiceSpec(raw["metadata"]["name"], raw["metadata"]["namespace"], raw["metadata"], raw["spec"])
    return spec, raw


def gpu_group_name(raw: dict[str, Any]) -> str:
    return f"gpu-{raw['metadata']['name']}"


def break_resources(raw: dict[str, Any]) -> None:
    spec = group(raw, gpu_group_name(raw))
    spec.pop("resources")
    spec["rayStartParams"]["resources"] = BROKEN_RESOURCES


def run(check: Any, *args: Any) -> tuple[Any, str]:
    out = io.StringIO()
    report = Report(out=out)
    result = check(args[0], report, *args[1:])
    return result, out.getvalue()


def words_for(raw: dict[str, Any]) -> list[str]:
    spec = kuberay.GroupSpec.from_spec(group(raw, gpu_group_name(raw)), is_head=False)
    command = kuberay.build_start_command(spec, head_address="h:6379", in_tree_autoscaling=True)
    return checks.bash_words(command.container_command)


def test_rays_parser_stops_on_the_bare_json_form() -> None:
    _, raw = service()
    break_resources(raw)
    with pytest.raises(checks.StartCommandError, match=r"Got unexpected extra argument \(1}\)"):
        checks.parse_ray_start(words_for(raw))


def test_rays_parser_takes_the_group_field_form() -> None:
    _, raw = service()
    parsed = checks.parse_ray_start(words_for(raw))
    assert parsed.node_resources() == {"CPU": 6.0, "GPU": 1.0, "memory": float(24 * 2**30), "accelerator_type:L4": 1.0}


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ('{"a":1}', "not a valid JSON object"),  # bash strips the unquoted double quotes
        ("'{\"CPU\":1}'", "cannot be a custom resource"),  # ray start's own RayParams check
    ],
)
def test_what_ray_start_parses_after_the_click_parser(resources: str, message: str) -> None:
    words = ["start", "--block", f"--resources={resources}"]
    words = checks.bash_words("ray " + " ".join(words))
    with pytest.raises(checks.StartCommandError, match=message):
        checks.parse_ray_start(words)


@pytest.mark.parametrize(
    ("stack", "parsed_groups"),
    [
        ("dev", {"headgroup"}),  # vllm-server: no ingress group
        (SERVE_INGRESS, {"headgroup", "ingress"}),
    ],
)
def test_a_broken_group_fails_with_one_line_naming_service_and_group(stack: str, parsed_groups: set[str]) -> None:
    spec, raw = service(stack)
    break_resources(raw)
    parsed, out = run(checks.check_start_commands, spec)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails == [line for line in fails if f"[{spec.name}] ray start ({gpu_group_name(raw)})" in line]
    assert len(fails) == 1 and "Got unexpected extra argument (1})" in fails[0]
    assert set(parsed) == parsed_groups


def test_rays_kuberay_conversion_fails_on_the_bare_json_and_names_the_group() -> None:
    spec, raw = service()
    break_resources(raw)
    config, out = run(checks.derive_autoscaling_config, spec, {})
    assert config is None
    assert f"FAIL [{spec.name}] autoscaling config ({gpu_group_name(raw)}): JSONDecodeError" in out


def test_the_committed_stacks_and_the_serve_ingress_example_pass_every_static_check() -> None:
    for stack in ("dev", "prod", SERVE_INGRESS):
        for index in range(len(ray_services(stack))):
            spec, _ = service(stack, index)
            result, out = run(checks.run_static_checks, spec, None)
            assert result is not None and "FAIL" not in out, out


def test_autoscaler_and_ray_start_must_agree_on_node_resources() -> None:
    """A fractional custom resource: KubeRay starts the node with 0.5, Ray's autoscaler plans with 1."""
    spec, raw = service()
    group(raw, gpu_group_name(raw))["resources"]["special"] = "500m"
    started, _ = run(checks.check_start_commands, spec)
    _, out = run(checks.derive_autoscaling_config, spec, started)
    assert "FAIL" in out and "special: autoscaler 1, ray start 0.5" in out


def with_accelerator(raw: dict[str, Any], accelerator: str | None) -> RayServiceSpec:
    serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["models"][0]["accelerator_type"] = accelerator
    raw["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    return RayServiceSpec(raw["metadata"]["name"], raw["metadata"]["namespace"], raw["metadata"], raw["spec"])


def placement_lines(spec: RayServiceSpec) -> str:
    config, _ = run(checks.derive_autoscaling_config, spec, {})
    _, out = run(checks.check_placements, spec, config, checks.model_groups_for(spec, None))
    return out


def test_a_mistyped_accelerator_never_fits_the_models_group() -> None:
    _, raw = service()
    out = placement_lines(with_accelerator(raw, "H100"))
    assert "FAIL" in out and "accelerator_type:H100 0.001 > 0" in out


def test_the_cpu_accelerator_on_a_gpu_group_fails_and_its_bundles_fit_the_ingress_group() -> None:
    """Serve's OpenAI ingress: Serve LLM's bundles without a GPU fit the ingress group's node too."""
    _, raw = service(SERVE_INGRESS)
    out = placement_lines(with_accelerator(raw, None))
    assert "FAIL" in out
    assert "asks for no GPU" in out and "also fit group ingress" in out


def test_the_cpu_accelerator_on_a_vllm_server_replica_fails_and_two_fit_one_gpu_node() -> None:
    """Dev's vllm-server replica without its accelerator asks for no GPU, so two would share one node's port."""
    _, raw = service("dev")
    out = placement_lines(with_accelerator(raw, None))
    assert out.startswith("FAIL") and "replica placement (llama-3.1-8b-instruct)" in out
    assert "the replica asks for 0 GPUs but a node of gpu-llama-31-8b has 1: vLLM would run on the CPU" in out
    assert "two replicas {CPU 1} fit one node of gpu-llama-31-8b" in out


@pytest.mark.parametrize(
    ("stack", "fits"),
    [
        (
            "dev",
            "the VllmServer:llama-3.1-8b-instruct replica {CPU 1, GPU 1, accelerator_type:L4 0.001} "
            "fits one node of gpu-llama-31-8b, once, and no other group",
        ),
        (SERVE_INGRESS, "fit one node of gpu-llama-31-8b and no other group"),
    ],
)
def test_the_rendered_accelerator_fits_only_its_group(stack: str, fits: str) -> None:
    spec, _ = service(stack)
    out = placement_lines(spec)
    assert out.startswith("PASS") and fits in out, out


def ingress_lines(spec: RayServiceSpec) -> str:
    config, _ = run(checks.derive_autoscaling_config, spec, {})
    _, out = run(checks.check_ingress_placement, spec, config)
    return out


def test_an_ingress_replica_that_fits_a_gpu_worker_fails() -> None:
    """Without the ingress-only resource a second ingress replica can take a GPU worker's CPUs."""
    _, raw = service(SERVE_INGRESS)
    group(raw, "ingress").pop("resources")
    serve = yaml.safe_load(raw["spec"]["serveConfigV2"])
    serve["applications"][0]["args"].pop("ingress_resource")
    raw["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    spec = RayServiceSpec(raw["metadata"]["name"], raw["metadata"]["namespace"], raw["metadata"], raw["spec"])
    out = ingress_lines(spec)
    assert out.startswith("FAIL") and f"also fits {gpu_group_name(raw)}" in out


def test_the_rendered_ingress_replica_fits_only_the_ingress_group() -> None:
    spec, _ = service(SERVE_INGRESS)
    out = ingress_lines(spec)
    assert out.startswith("PASS") and out.rstrip().endswith("fits ingress"), out


def test_a_vllm_server_service_has_no_ingress_to_place() -> None:
    """Dev and prod serve vllm-server: a router (dev) or the load balancer (prod) reaches the replicas' servers,
    no Serve ingress runs."""
    for stack in ("dev", "prod"):
        for index in range(len(ray_services(stack))):
            spec, _ = service(stack, index)
            assert ingress_lines(spec) == "", stack
