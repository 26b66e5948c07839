"""How the twin fits a rendered RayService to this machine (twin/shape.py, twin/deploy.py, twin/serve_app.py).

Every change to the render must be deliberate and printed; what must not
change (bounds, custom resources, the catalogue's own settings) must not.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import SERVE_INGRESS, ray_services
from twin import serve_app
from twin.checks import ParsedStart
from twin.cluster import FAKE_HEAD_NODE_TYPE, PROVIDER_CLASS, Shape, autoscaling_config
from twin.deploy import ACCELERATOR_SLIVER, Fitting, twin_serve_config
from twin.shape import MAX_NODE_CPUS, fit_shape, pod_env

GIB = 2**30
AUTOSCALING: dict[str, Any] = {
    "idle_timeout_minutes": 5.0,
    "upscaling_speed": 1000,
    "available_node_types": {
        "headgroup": {"min_workers": 0, "max_workers": 0, "resources": {"CPU": 0, "memory": 8 * GIB}},
        "ingress": {"min_workers": 2, "max_workers": 6, "resources": {"CPU": 2, "memory": 4 * GIB}},
        "gpu-big": {
            "min_workers": 1,
            "max_workers": 4,
            "idle_timeout_s": 900.0,
            "resources": {"CPU": 42, "GPU": 4, "memory": 341 * GIB, "accelerator_type:L40S": 1},
        },
    },
}
HEAD = ParsedStart(
    argv=[],
    params={
        "num_cpus": 0,
        "memory": 8 * GIB,
        "no_monitor": True,
        "dashboard_host": "0.0.0.0",
        "metrics_export_port": 8080,
        "dashboard_agent_listen_port": 52365,
    },
    resources={},
)


def shape() -> tuple[Shape, list[str]]:
    fitted = fit_shape("svc", AUTOSCALING, HEAD, 18000, {"RAY_SERVE_X": "1"})
    return fitted.shape, fitted.substitutions


def test_node_types_keep_bounds_and_custom_resources_and_cap_cpu_and_memory() -> None:
    fitted, subs = shape()
    types_ = {t.name: t for t in fitted.worker_types}
    big = types_["gpu-big"]
    assert (big.min_workers, big.max_workers) == (1, 4)
    assert big.resources["CPU"] == MAX_NODE_CPUS and big.resources["memory"] == 2 * GIB
    assert big.resources["GPU"] == 4 and big.resources["accelerator_type:L40S"] == 1
    assert big.idle_timeout_s == 15.0 and fitted.idle_timeout_minutes == 0.25
    assert (types_["ingress"].min_workers, types_["ingress"].max_workers) == (2, 6)
    assert any("gpu-big: CPU 42 -> 4; memory 341Gi -> 2Gi" in s for s in subs)
    assert any("idle timeout 300s -> 15s" in s for s in subs)
    assert fitted.env["RAY_SERVE_X"] == "1" and fitted.env["RAY_enable_autoscaler_v2"] == "1"


def test_the_rendered_idle_timeout_can_be_kept() -> None:
    fitted = fit_shape("svc", AUTOSCALING, HEAD, 18000, {}, idle_timeout_s=None).shape
    assert fitted.idle_timeout_minutes == 5.0
    assert {t.name: t.idle_timeout_s for t in fitted.worker_types}["gpu-big"] == 900.0


def test_head_arguments_start_from_kuberays_and_stay_on_loopback_ports() -> None:
    fitted, subs = shape()
    args = fitted.head_args
    assert args[:3] == ["start", "--head", "--block"]
    assert "--num-cpus=0" in args and f"--memory={2 * GIB}" in args
    assert "--no-monitor" not in args and "--include-dashboard=false" in args
    assert not any(a.endswith(("=8080", "=52365", "=8265")) for a in args)
    assert any("--no-monitor dropped" in s for s in subs)


def test_the_autoscaler_runs_rays_fake_provider_with_the_stacks_node_types() -> None:
    fitted, _ = shape()
    config = autoscaling_config(fitted, "127.0.0.1:1234", Path("/tmp/nodes.json"))
    assert config["provider"]["module"] == PROVIDER_CLASS and config["provider"]["gcs_address"] == "127.0.0.1:1234"
    assert set(config["available_node_types"]) == {FAKE_HEAD_NODE_TYPE, "ingress", "gpu-big"}
    assert config["max_workers"] == 10


def test_pod_env_forwards_only_serve_settings_the_groups_share() -> None:
    cluster = {
        "headGroupSpec": {"template": {"spec": {"containers": [{"env": [{"name": "RAY_SERVE_A", "value": "1"}]}]}}},
        "workerGroupSpecs": [
            {"template": {"spec": {"containers": [{"env": [{"name": "HOME", "value": "/x"}]}]}}},
        ],
    }
    assert pod_env(cluster) == {"RAY_SERVE_A": "1"}


def dev_serve_config(stack: str = "dev") -> dict[str, Any]:
    """The serve config of dev's one RayService, or of a variant of dev's file such as SERVE_INGRESS."""
    config: dict[str, Any] = yaml.safe_load(ray_services(stack)[0]["spec"]["serveConfigV2"])
    return config


def test_serve_config_changes_only_what_the_cpu_needs(tmp_path: Path) -> None:
    """On Serve's OpenAI ingress (SERVE_INGRESS), the model's placement group gets the sliver of the accelerator."""
    rendered = dev_serve_config(SERVE_INGRESS)
    twin = twin_serve_config(rendered, model_dir=tmp_path / "m", secrets_dir=tmp_path / "s", http_port=18001)
    app = twin.config["applications"][0]
    assert app["import_path"] == serve_app.IMPORT_PATH
    assert app["args"]["import_path"] == rendered["applications"][0]["import_path"]
    catalog = app["args"]["args"]
    model = catalog["models"][0]
    assert model["source"] == str(tmp_path / "m") and model["accelerator_type"] is None
    assert (model["tensor_parallel_size"], model["pipeline_parallel_size"], model["dtype"]) == (1, 1, "float32")
    assert model["autoscaling"]["downscale_delay_s"] == 15
    original = rendered["applications"][0]["args"]
    assert model["autoscaling"]["max_replicas"] == original["models"][0]["autoscaling"]["max_replicas"]
    assert catalog["limits"] == original["limits"] and catalog["ingress"] == original["ingress"]
    assert app["args"]["placement_group_configs"] == {
        model["model_id"]: {"bundles": [{"CPU": 1, "accelerator_type:L4": ACCELERATOR_SLIVER}]}
    }
    assert twin.config["http_options"] == {"host": "127.0.0.1", "port": 18001}
    keys = Path(catalog["api_keys_file"]).read_text().splitlines()
    assert f"twin:{twin.api_key}" in keys
    assert [f"client-{i:02d}:{k}" for i, k in enumerate(twin.client_keys)] == keys[2:]
    assert len(set(twin.client_keys) | {twin.api_key}) == 1 + len(twin.client_keys) > 8
    assert twin.models[0].min_replicas == 0 and twin.models[0].accelerator_type == "L4"
    assert len(twin.substitutions) >= 4


def test_the_local_run_keeps_the_rendered_delays(tmp_path: Path) -> None:
    twin = twin_serve_config(
        dev_serve_config(),
        model_dir=tmp_path,
        secrets_dir=tmp_path,
        http_port=1,
        fitting=Fitting(downscale_delay_s=None),
    )
    assert twin.config["applications"][0]["args"]["args"]["models"][0]["autoscaling"]["downscale_delay_s"] == 600


def test_the_twin_builder_adds_the_placement_to_the_models_llm_config(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []
    module = types.ModuleType("fake_builder")

    def llm_config(**kwargs: Any) -> dict[str, Any]:
        made.append(kwargs)
        return kwargs

    module.LLMConfig = llm_config  # type: ignore[attr-defined]

    def build(args: dict[str, Any]) -> list[Any]:
        return [module.LLMConfig(model_loading_config={"model_id": m}) for m in args["models"]]  # type: ignore[attr-defined]

    module.build = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_builder", module)
    placement = {"bundles": [{"CPU": 1, "accelerator_type:L4": 0.001}]}
    serve_app.build_app(
        {
            "import_path": "fake_builder:build",
            "args": {"models": ["a", "b"]},
            "placement_group_configs": {"a": placement},
        }
    )
    assert made[0]["placement_group_config"] == placement and "placement_group_config" not in made[1]
    assert module.LLMConfig is llm_config  # type: ignore[attr-defined]


def prod_serve_config(index: int) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(ray_services("prod")[index]["spec"]["serveConfigV2"])
    return config


@pytest.mark.usefixtures("needs_ray")
def test_a_vllm_server_catalogue_runs_on_loopback_and_keeps_the_rendered_replica_options(tmp_path: Path) -> None:
    """Every local node shares 127.0.0.1: free ports, published in files; the actor still asks for its GPUs."""
    rendered = prod_serve_config(1)
    twin = twin_serve_config(
        rendered, model_dir=tmp_path / "m", secrets_dir=tmp_path / "s", http_port=18002, address_root=tmp_path / "a"
    )
    app = twin.config["applications"][0]
    catalog = app["args"]["args"]
    name = rendered["applications"][0]["name"]
    assert catalog["layout"] == "vllm-server"
    assert catalog["vllm_server"] == {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "address_dir": str(tmp_path / "a" / name),
        "drain_notice_s": rendered["applications"][0]["args"]["vllm_server"]["drain_notice_s"],
    }
    assert (tmp_path / "a" / name).is_dir()
    assert app["args"]["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 4, "accelerator_type": "L40S"}
    assert app["args"]["placement_group_configs"] == {}
    model = catalog["models"][0]
    assert model["accelerator_type"] is None and model["tensor_parallel_size"] == 1
    info = twin.models[0]
    assert (info.layout, info.min_replicas, info.address_dir) == ("vllm-server", 2, tmp_path / "a" / name)
    assert twin.ingress_min_replicas == {}
    assert any("the replica actor keeps the rendered options" in s for s in twin.substitutions)


@pytest.mark.usefixtures("needs_ray")
def test_the_twin_builder_puts_back_the_rendered_actor_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray import serve

    class Server:
        def __init__(self, catalog: dict[str, Any]) -> None:
            self.catalog = catalog

    module = types.ModuleType("fake_server_builder")

    def build(args: dict[str, Any]) -> Any:
        return serve.deployment(Server).options(name="S", ray_actor_options={"num_cpus": 1, "num_gpus": 0}).bind(args)

    module.build = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_server_builder", module)
    app = serve_app.build_app(
        {
            "import_path": "fake_server_builder:build",
            "args": {"models": ["a"]},
            "ray_actor_options": {"num_gpus": 4, "accelerator_type": "L40S"},
        }
    )
    deployment = app._bound_deployment
    assert deployment.name == "S" and deployment._replica_config.init_args == ({"models": ["a"]},)
    resources = {k: v for k, v in deployment._replica_config.resource_dict.items() if v}
    assert resources == {"CPU": 1, "GPU": 4, "accelerator_type:L40S": 0.001}


def test_a_model_at_zero_stops_as_quickly_as_the_twin_scales_it_down(tmp_path: Path) -> None:
    """Dev with routing and the gateway (its model vllm-server at min_replicas 0): the drain notice is
    shortened with the downscale delay, and kept where the delays are (the local run) or the model never
    reaches zero (prod)."""
    from tests.harness import manifests_of, render_routed

    (rs,) = manifests_of(render_routed("dev"), "RayService")
    woken = yaml.safe_load(rs["spec"]["serveConfigV2"])
    rendered_notice = woken["applications"][0]["args"]["vllm_server"].get("drain_notice_s", 40)
    twin = twin_serve_config(woken, model_dir=tmp_path / "m", secrets_dir=tmp_path / "s", http_port=1)
    assert twin.config["applications"][0]["args"]["args"]["vllm_server"]["drain_notice_s"] == 5 < rendered_notice
    assert any("drain_notice_s" in line for line in twin.substitutions)
    local = twin_serve_config(
        woken,
        model_dir=tmp_path / "m",
        secrets_dir=tmp_path / "t",
        http_port=1,
        fitting=Fitting(downscale_delay_s=None),
    )
    assert local.config["applications"][0]["args"]["args"]["vllm_server"].get("drain_notice_s") == rendered_notice
    rendered_prod = prod_serve_config(0)
    prod_notice = rendered_prod["applications"][0]["args"]["vllm_server"].get("drain_notice_s")
    prod = twin_serve_config(rendered_prod, model_dir=tmp_path / "m", secrets_dir=tmp_path / "u", http_port=1)
    assert prod.config["applications"][0]["args"]["args"]["vllm_server"].get("drain_notice_s") == prod_notice
