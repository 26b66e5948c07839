"""The `ray start` line KubeRay 1.7 builds from a group (twin/kuberay.py), and what bash makes of it. No Ray."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest

from infra.config import Model
from infra.serving.ray_service import worker_group_name
from tests.harness import group, ray_services
from twin import kuberay
from twin.checks import bash_words, model_groups_for
from twin.render import RayServiceSpec

HEAD_ADDRESS = "svc-head-svc.llm.svc.cluster.local:6379"
# The form the program wrote before: bare JSON in rayStartParams, a space after the colon.
BROKEN_RESOURCES = '{"accelerator_type:L4": 1}'


def dev_gpu_group() -> dict[str, Any]:
    service = ray_services("dev")[0]
    return copy.deepcopy(group(service, f"gpu-{service['metadata']['name']}"))


def command_of(spec: dict[str, Any], *, is_head: bool = False, in_tree: bool = True) -> kuberay.StartCommand:
    return kuberay.build_start_command(
        kuberay.GroupSpec.from_spec(spec, is_head=is_head), head_address=HEAD_ADDRESS, in_tree_autoscaling=in_tree
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", Decimal(2)),
        ("500m", Decimal("0.5")),
        ("4Gi", Decimal(4 * 2**30)),
        ("1e3", Decimal(1000)),
        ("1.5k", Decimal(1500)),
    ],
)
def test_quantities_parse_as_kubernetes_does(text: str, value: Decimal) -> None:
    assert kuberay.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "one", "4GB", "1..2", "--1"])
def test_bad_quantities_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        kuberay.parse_quantity(text)


def test_quantity_value_rounds_up() -> None:
    assert [kuberay.quantity_value(t) for t in ("500m", "1.2", "3")] == [1, 2, 3]


def test_go_json_is_compact_sorted_with_integral_floats() -> None:
    assert kuberay.go_json_object({"b": 1.0, "a": 0.5}) == '{"a":0.5,"b":1}'


def test_param_map_switches_and_verbatim_values() -> None:
    flags = kuberay.convert_param_map(
        {"block": "true", "no-monitor": "False", "include-dashboard": "false", "resources": '{"a": 1}', "num-cpus": "2"}
    )
    assert flags == ' --block  --include-dashboard=false  --num-cpus=2  --resources={"a": 1} '


def test_gpu_group_field_becomes_a_quoted_resources_flag() -> None:
    command = command_of(dev_gpu_group())
    line = command.ray_start
    assert line.startswith("ray start ")
    assert "--resources='{\"accelerator_type:L4\":1}'" in line
    for flag in ("--num-cpus=6", "--num-gpus=1", f"--memory={24 * 2**30}", "--block", f"--address={HEAD_ADDRESS}"):
        assert f" {flag} " in line, flag
    assert command.container_command.startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start")


def test_bare_json_in_ray_start_params_is_written_verbatim() -> None:
    spec = dev_gpu_group()
    spec.pop("resources")
    spec["rayStartParams"]["resources"] = BROKEN_RESOURCES
    assert f" --resources={BROKEN_RESOURCES} " in command_of(spec).ray_start


def test_bash_splits_the_bare_json_and_keeps_the_quoted_one() -> None:
    broken = dev_gpu_group()
    broken.pop("resources")
    broken["rayStartParams"]["resources"] = BROKEN_RESOURCES
    broken_words = bash_words(command_of(broken).container_command)
    assert "--resources={accelerator_type:L4:" in broken_words and "1}" in broken_words
    fixed_words = bash_words(command_of(dev_gpu_group()).container_command)
    assert '--resources={"accelerator_type:L4":1}' in fixed_words
    assert fixed_words[0] == "start"


def test_head_gets_no_monitor_and_the_dashboard_host() -> None:
    head = ray_services("dev")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]
    line = command_of(head, is_head=True).ray_start
    assert line.startswith("ray start --head ")
    assert " --no-monitor " in line and " --dashboard-host=0.0.0.0 " in line and " --num-cpus=0 " in line
    assert " --no-monitor " not in command_of(head, is_head=True, in_tree=False).ray_start


def test_group_labels_and_accelerator_limits() -> None:
    spec = {
        "groupName": "g",
        "rayStartParams": {},
        "labels": {"zone": "b", "tier": "a"},
        "template": {
            "spec": {"containers": [{"resources": {"limits": {"cpu": "500m", "aws.amazon.com/neuroncore": "2"}}}]}
        },
    }
    params = command_of(spec).params
    assert params["labels"] == "tier=a,zone=b"
    assert params["num-cpus"] == "1"
    assert params["resources"] == "'{\"neuron_cores\":2}'"


def test_mig_limits_count_as_gpus() -> None:
    spec = {
        "groupName": "g",
        "rayStartParams": {},
        "template": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}]}},
    }
    assert command_of(spec).params["num-gpus"] == "2"


def test_unparseable_ray_start_resources_stop_the_gpu_count() -> None:
    """The operator returns before it sets num-gpus when rayStartParams.resources is not JSON."""
    spec = dev_gpu_group()
    spec.pop("resources")
    spec["rayStartParams"]["resources"] = '"{\\"Custom\\": 1}"'
    assert "num-gpus" not in command_of(spec).params


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rayStartParams": {"num-cpus": "2"}}, "together with rayStartParams"),
        ({"rayStartParams": {"resources": BROKEN_RESOURCES}}, "together with rayStartParams"),
        ({"rayStartParams": {"labels": "a=b"}}, "rayStartParams.labels"),
    ],
)
def test_the_operator_rejects_mixed_forms(edit: dict[str, Any], message: str) -> None:
    spec = dev_gpu_group()
    spec["rayStartParams"].update(edit["rayStartParams"])
    with pytest.raises(kuberay.KubeRayValidationError, match=message):
        command_of(spec)


def test_model_groups_follow_the_programs_group_names() -> None:
    assert worker_group_name(Model.model_construct(name="llama-x")) == "gpu-llama-x"
    raw = ray_services("prod")[1]
    service = RayServiceSpec(raw["metadata"]["name"], "llm", raw["metadata"], raw["spec"])
    assert model_groups_for(service, {"llama-3.3-70b-instruct": "llama-33-70b"}) == {
        "llama-3.3-70b-instruct": "gpu-llama-33-70b"
    }
    assert model_groups_for(service, None) == {"llama-3.3-70b-instruct": "gpu-llama-33-70b"}
