"""Cold start: S3 gateway endpoint, node bootstrap, the GPU pod's caches and timeouts, the budget and its rules."""

from __future__ import annotations

import base64
import email
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.aws import node_bootstrap
from infra.aws.node_groups import has_instance_store
from infra.capacity import cold_start
from infra.capacity.report import cold_start_line
from infra.config import ConfigError, cold_start_budget, duration_seconds, parse, pulumi_wait_seconds
from infra.instance_types import GPU_INSTANCE_TYPES, HOST_IO, host_io
from infra.mocks import _hex
from infra.scheduling import gpu_placements
from infra.serving.ray_service import (
    AUTOSCALER_ALLOCATE_TIMEOUT_ENV,
    AUTOSCALER_RAY_INSTALL_TIMEOUT_ENV,
    ENGINE_CACHE_VOLUME,
    ENGINE_START_TIMEOUT_ENV,
)
from infra.serving.serve_config import MOUNTS, catalog
from tests.harness import (
    SERVE_INGRESS,
    by_type,
    group,
    ray_services,
    render_cli,
    render_stack,
    stack_config,
    stack_doc,
    stack_sections,
)
from workloads.inference_server.catalog import Catalog, S3Streamer
from workloads.inference_server.engine import engine_kwargs, streamer_config

NS = "llm-platform:"


# --- network ------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_s3_gateway_endpoint_sits_on_every_private_route_table(stack: str) -> None:
    rendered, cfg = render_stack(stack), stack_config(stack)
    (endpoint,) = by_type(rendered, "aws:ec2/vpcEndpoint:VpcEndpoint")
    inputs = endpoint["inputs"]
    assert inputs["vpcEndpointType"] == "Gateway"
    assert inputs["serviceName"] == f"com.amazonaws.{cfg.region}.s3"
    # One table per private subnet, looked up by the subnet awsx made (mocks: rtb-<hash of the subnet id>).
    private = [f"subnet-{_hex('network', 'private', z, n=17)}" for z in cfg.network.zones]
    assert inputs["routeTableIds"] == [f"rtb-{_hex(s, n=17)}" for s in private]


# --- node bootstrap -------------------------------------------------------------


def _nodeadm(user_data: str) -> dict[str, Any]:
    message = email.message_from_string(user_data)
    assert message.is_multipart()
    parts = [p for p in message.walk() if p.get_content_type() == node_bootstrap.NODEADM_CONTENT_TYPE]
    assert len(parts) == 1
    doc: dict[str, Any] = json.loads(str(parts[0].get_payload()))
    return doc


def test_al2023_user_data_is_a_nodeadm_part_with_raid0_and_fast_image_pull() -> None:
    doc = _nodeadm(node_bootstrap.gpu_user_data("AL2023_x86_64_NVIDIA", instance_store=True))
    assert doc["kind"] == "NodeConfig" and doc["apiVersion"] == "node.eks.aws/v1alpha1"
    assert doc["spec"]["instance"]["localStorage"]["strategy"] == "RAID0"
    assert doc["spec"]["featureGates"] == {"FastImagePull": True}
    # No instance store: no RAID0 (nodeadm would have nothing to stripe), SOCI still on.
    bare = _nodeadm(node_bootstrap.gpu_user_data("AL2023_x86_64_NVIDIA", instance_store=False))
    assert "instance" not in bare["spec"] and bare["spec"]["featureGates"]["FastImagePull"] is True


def test_bottlerocket_user_data_is_toml_with_soci_parallel_pull_and_ephemeral_raid0() -> None:
    settings = tomllib.loads(node_bootstrap.gpu_user_data("BOTTLEROCKET_x86_64_NVIDIA", instance_store=True))[
        "settings"
    ]
    assert settings["container-runtime"]["snapshotter"] == "soci"
    soci = settings["container-runtime-plugins"]["soci-snapshotter"]
    assert soci["pull-mode"] == "parallel-pull-unpack"
    assert soci["parallel-pull-unpack"]["max-concurrent-downloads-per-image"] > 3  # containerd's default
    commands = settings["bootstrap-commands"]["k8s-ephemeral-storage"]["commands"]
    assert commands[0] == ["apiclient", "ephemeral-storage", "init"]
    assert commands[1][:4] == ["apiclient", "ephemeral-storage", "bind", "--dirs"]
    assert {"/var/lib/containerd", "/var/lib/kubelet", "/var/lib/soci-snapshotter"} <= set(commands[1][4:])
    bare = tomllib.loads(node_bootstrap.gpu_user_data("BOTTLEROCKET_x86_64_NVIDIA", instance_store=False))
    assert "bootstrap-commands" not in bare["settings"]


def test_prod_gpu_launch_templates_carry_the_bootstrap_and_the_system_one_none() -> None:
    rendered, cfg = render_stack("prod"), stack_config("prod")
    templates = {t["name"]: t["inputs"] for t in by_type(rendered, "aws:ec2/launchTemplate:LaunchTemplate")}
    assert "userData" not in templates["nodes-system"]
    for g in cfg.node_groups.gpu:
        (name,) = [n for n in templates if n.endswith(g.name)]
        text = base64.b64decode(templates[name]["userData"]).decode()
        assert has_instance_store(g.instance_types)
        if g.ami == "al2023_nvidia":
            assert _nodeadm(text)["spec"]["instance"]["localStorage"]["strategy"] == "RAID0"
        else:
            assert tomllib.loads(text)["settings"]["container-runtime"]["snapshotter"] == "soci"


def test_every_gpu_instance_type_has_its_network_and_instance_store() -> None:
    assert set(HOST_IO) == set(GPU_INSTANCE_TYPES)
    assert all(io.network_gbps > 0 and io.instance_store_gb > 0 for io in HOST_IO.values())
    assert not has_instance_store(["m7i.xlarge"])


# --- the GPU pod ----------------------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_gpu_workers_keep_engine_caches_on_an_emptydir_and_have_no_ebs_volume(stack: str) -> None:
    cfg = stack_config(stack)
    for rs in ray_services(stack):
        for model in [m for m in cfg.models if m.service_name == rs["metadata"]["name"]]:
            spec = group(rs, f"gpu-{model.name}")["template"]["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert not any("ephemeral" in v or "persistentVolumeClaim" in v for v in spec["volumes"])
            (ray,) = [c for c in spec["containers"] if c["name"] == "ray"]
            mounts = {m["name"]: m["mountPath"] for m in ray["volumeMounts"]}
            assert "emptyDir" in volumes[ENGINE_CACHE_VOLUME]
            root = mounts[ENGINE_CACHE_VOLUME]
            env = _env(ray)
            for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
                assert env[key].startswith(root + "/"), key
            assert env[ENGINE_START_TIMEOUT_ENV] == str(cfg.ray.cold_start.engine_start_seconds)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_autoscaler_timeouts_and_pulumi_wait_are_the_configured_ones(stack: str) -> None:
    cfg = stack_config(stack)
    for rs in ray_services(stack):
        options = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]
        env = {e["name"]: e["value"] for e in options["env"]}
        assert env[AUTOSCALER_ALLOCATE_TIMEOUT_ENV] == str(cfg.ray.cold_start.autoscaler_allocate_seconds)
        assert env[AUTOSCALER_RAY_INSTALL_TIMEOUT_ENV] == str(cfg.ray.cold_start.autoscaler_ray_install_seconds)
        models = [m for m in cfg.models if m.service_name == rs["metadata"]["name"]]
        assert rs["metadata"]["annotations"]["pulumi.com/timeoutSeconds"] == str(pulumi_wait_seconds(cfg, models))


def test_the_ray_autoscaler_reads_the_variables_the_program_sets() -> None:
    """The names are Ray 2.60's own (a rename upstream would silently drop the setting)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        pytest.skip("ray is not installed")
    ray_dir = Path(spec.origin).parent
    autoscaler = (ray_dir / "autoscaler/v2/instance_manager/config.py").read_text()
    assert AUTOSCALER_ALLOCATE_TIMEOUT_ENV in autoscaler and AUTOSCALER_RAY_INSTALL_TIMEOUT_ENV in autoscaler
    assert ENGINE_START_TIMEOUT_ENV in (ray_dir / "llm/_internal/serve/constants.py").read_text()
    vllm = importlib.util.find_spec("vllm")
    if vllm is not None and vllm.origin is not None:
        envs = (Path(vllm.origin).parent / "envs.py").read_text()
        assert all(f'"{name}"' in envs for name in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME"))


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_s3_models_stream_with_settings_sized_from_the_network(stack: str) -> None:
    """The streamer settings as the server parses them from the rendered serveConfigV2, and vLLM's arguments."""
    cfg = stack_config(stack)
    gpu = gpu_placements(cfg)
    per_stream = cold_start.figure("s3_per_connection_bytes_s")
    seen = set()
    for rs in ray_services(stack):
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        served = Catalog.model_validate(args)
        for raw, entry in zip(args["models"], served.models, strict=True):
            model = next(m for m in cfg.models if m.model_id == entry.model_id)
            seen.add(model.name)
            instance = gpu[model.gpu_group].instance
            io, ranks = host_io(instance.name), min(model.num_devices, instance.gpus)
            kwargs = engine_kwargs(entry, served)
            assert kwargs["load_format"] == "runai_streamer"
            extra = kwargs["model_loader_extra_config"]
            # Distributed exactly where a node holds several ranks; elsewhere neither the args nor vLLM's name it.
            assert extra.get("distributed", False) is (ranks > 1), model.name
            assert ("distributed" in raw["streamer"]) is (ranks > 1), model.name
            # The node's ranks together open enough S3 streams for its usable line rate, and not a rank's worth more.
            usable = io.network_bytes_s * cold_start.figure("s3_network_share")
            node_streams = extra["concurrency"] * ranks
            assert node_streams * per_stream >= min(usable, node_streams * cold_start.STREAMER_MAX_CONCURRENCY)
            assert extra["concurrency"] == cold_start.STREAMER_MIN_CONCURRENCY or (
                (node_streams - ranks) * per_stream < usable
            )
            # A buffer of at most two seconds of line rate (distributed: for the node, split over its ranks).
            assert 0 < extra["memory_limit"] <= io.network_bytes_s * cold_start.STREAMER_BUFFER_SECONDS
    assert seen == {m.name for m in cfg.models}
    assert MOUNTS.cache_dir != MOUNTS.model_cache_dir


def test_vllm_takes_the_streamer_config_the_server_builds() -> None:
    """vLLM 0.29's runai loader refuses any other key, and a `distributed` that is not a bool."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    loader = (Path(spec.origin).parent / "model_executor/model_loader/runai_streamer_loader.py").read_text()
    allowed = re.search(r"allowed_keys = \{([^}]*)\}", loader)
    assert allowed is not None
    config = streamer_config(S3Streamer(concurrency=23, memory_limit=2**30, distributed=True))
    assert (
        set(config) == set(re.findall(r'"(\w+)"', allowed.group(1))) == {"distributed", "concurrency", "memory_limit"}
    )
    assert config["distributed"] is True and "isinstance(distributed, bool)" in loader


def test_a_faster_nic_gets_more_streams() -> None:
    slow, fast = host_io("g6.2xlarge"), host_io("g6e.12xlarge")
    assert cold_start.streamer_concurrency(fast) > cold_start.streamer_concurrency(slow)
    # A small pod's buffer is capped by its memory, not by the NIC.
    assert cold_start.streamer_memory_limit(host_io("p5.48xlarge"), 8) <= 2 * 2**30


# --- the budget -------------------------------------------------------------------


def test_budget_is_the_sum_of_its_phases_from_the_pinned_figures() -> None:
    cfg = stack_config("prod")
    big = next(m for m in cfg.models if m.tensor_parallel_size == 4)
    budget = cold_start_budget(cfg, big)
    io = host_io(budget.instance)
    assert budget.total == pytest.approx(sum(budget.phases().values()), abs=6)
    weight_bytes = big.weights_gib() * 2**30
    assert budget.weights == pytest.approx(weight_bytes / (io.network_bytes_s * cold_start.figure("s3_network_share")))
    assert budget.node_ready == cold_start.figure("node_ready_g")
    assert budget.engine_init == cold_start.figure("engine_init") + cold_start.figure("engine_init_tp")
    download = (
        cold_start.figure("image_compressed_gb") * 1e9 / (io.network_bytes_s * cold_start.figure("pull_network_share"))
    )
    assert budget.image_pull >= download
    line = cold_start_line(budget)
    assert line.startswith(f"cold start {big.name}: {budget.total:.0f} s budget on a new {budget.instance} node")


def _prod_70b(cfg: Any) -> Any:
    return next(m for m in cfg.models if m.name == "llama-33-70b")


def test_the_prod_70b_reads_its_checkpoint_once_a_node_not_once_a_rank() -> None:
    """70.6 B bf16 parameters are 141.2 GB; g6e.12xlarge's 100 Gbps at the S3 share streams 7.5 GB/s: 19 s.

    Its four TP ranks stream distributed, so the node reads the checkpoint
    once; if each rank read all of it (the streamer's default), four times:
    75 s. The rendered settings are the ones that make the first true.
    """
    cfg = stack_config("prod")
    big = _prod_70b(cfg)
    assert (big.parameters_billion, big.dtype, big.tensor_parallel_size) == (70.6, "bfloat16", 4)
    budget = cold_start_budget(cfg, big)
    assert budget.instance == "g6e.12xlarge" and host_io(budget.instance).network_gbps == 100
    checkpoint = 70.6e9 * 2
    node_rate = 100e9 / 8 * cold_start.figure("s3_network_share")
    assert budget.checkpoint_copies == 1 and budget.node_read_bytes == pytest.approx(checkpoint)
    assert budget.weights == pytest.approx(checkpoint / node_rate)
    one_copy = round(checkpoint / node_rate)
    assert f", weights {one_copy} s for 141 GB a node, " in cold_start_line(budget)

    (streamer,) = [e.streamer for e in catalog(cfg, [big], gpu_placements(cfg)).models]
    assert streamer is not None and streamer.distributed
    # Each of the 4 ranks opens a quarter of the streams the NIC's usable rate needs.
    assert streamer.concurrency == math.ceil(node_rate / cold_start.figure("s3_per_connection_bytes_s") / 4)

    def undistributed(c: dict[str, Any]) -> None:
        (model,) = [m for m in c[f"{NS}models"] if m["name"] == big.name]
        model["streamer"] = {"concurrency": streamer.concurrency, "memory_limit": streamer.memory_limit}

    plain_cfg = parse(stack_sections("prod", undistributed))
    plain = cold_start_budget(plain_cfg, _prod_70b(plain_cfg))
    assert plain.checkpoint_copies == 4 and plain.node_read_bytes == pytest.approx(4 * checkpoint)
    assert plain.weights == pytest.approx(4 * budget.weights)
    assert f"weights {round(4 * checkpoint / node_rate)} s for 565 GB a node: 4 ranks each read all 141 GB" in (
        cold_start.describe(plain)
    )


def test_a_replica_over_two_nodes_reads_the_whole_checkpoint_on_each() -> None:
    """A pipeline stage on each one-GPU node: vLLM streams every file to every rank, so no node reads less.

    Alone on its node, a rank has no one to share reads with: it streams as a one-rank replica does.
    """

    def two_stages(c: dict[str, Any]) -> None:
        c[f"{NS}models"][0]["pipeline_parallel_size"] = 2
        c[f"{NS}node_groups"]["gpu"][0]["max_size"] = 4

    # Pipeline stages run on Serve's ingress (the vllm-server layout serves one node's engine).
    cfg, one_stage = parse(stack_sections(SERVE_INGRESS, two_stages)), stack_config(SERVE_INGRESS)
    model = cfg.models[0]
    assert model.num_devices == 2 and gpu_placements(cfg)[model.gpu_group].instance.gpus == 1
    budget = cold_start_budget(cfg, model)
    assert budget.node_read_bytes == pytest.approx(model.weights_gib() * 2**30)
    assert budget.weights == pytest.approx(cold_start_budget(one_stage, one_stage.models[0]).weights)
    (streamer,) = [e.streamer for e in catalog(cfg, [model], gpu_placements(cfg)).models]
    assert streamer is not None and not streamer.distributed


def test_every_figure_says_where_it_comes_from() -> None:
    for key, fig in cold_start.FIGURES.items():
        assert fig.value > 0 and len(fig.source) > 20, key


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_cold_start_stack_output(stack: str) -> None:
    out, cfg = render_stack(stack).outputs["cold_start"], stack_config(stack)
    assert set(out["models"]) == {m.name for m in cfg.models}
    for model in cfg.models:
        budget = cold_start_budget(cfg, model)
        assert out["models"][model.name]["total_seconds"] == round(budget.total)
        assert out["models"][model.name]["phases_seconds"] == budget.phases()
    assert set(out["figures"]) == set(cold_start.FIGURES)


# --- the rule -------------------------------------------------------------------------


def _problems(stack: str, edit: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(stack_sections(stack, edit))
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize(
    ("key", "covers"),
    [
        ("engine_start_seconds", "in_container"),
        ("autoscaler_allocate_seconds", "to_ray_up"),
        ("autoscaler_ray_install_seconds", "to_ray_up"),
        ("pulumi_wait_seconds", "total"),
    ],
)
def test_a_timeout_below_the_budget_is_refused_and_one_at_it_accepted(key: str, covers: str) -> None:
    cfg = stack_config("dev")
    budget = cold_start_budget(cfg, cfg.models[0])
    exact = cold_start.required(budget, covers)
    need = math.ceil(exact)

    def setting(value: int) -> Any:
        def edit(c: dict[str, Any]) -> None:
            c.setdefault(f"{NS}ray", {}).setdefault("cold_start", {})[key] = value

        return edit

    (line,) = _problems("dev", setting(need - 1))
    assert line.startswith(f"config error: ray.cold_start.{key}: {need - 1} s is shorter than the cold-start budget")
    assert f"'{cfg.models[0].name}'" in line and f"cover: {exact:.0f} s (" in line
    parse(stack_sections("dev", setting(need)))


def test_a_prescale_lead_time_below_the_budget_is_refused() -> None:
    cfg = stack_config("prod")
    window = cfg.autoscaling.prescale[0]
    longest = max(
        (cold_start_budget(cfg, m) for m in cfg.models if m.gpu_group == window.gpu_group), key=lambda b: b.total
    )

    def lead(value: int) -> Any:
        def edit(c: dict[str, Any]) -> None:
            c[f"{NS}autoscaling"]["prescale"][0]["lead_seconds"] = value

        return edit

    (line,) = _problems("prod", lead(60))
    assert line.startswith("config error: autoscaling.prescale[0].lead_seconds: 60 s is shorter")
    parse(stack_sections("prod", lead(math.ceil(longest.total))))


def test_cluster_autoscaler_provision_time_must_cover_node_ready() -> None:
    def short(c: dict[str, Any]) -> None:
        c.setdefault(f"{NS}autoscaling", {}).setdefault("cluster", {})["max_node_provision_time"] = "2m"

    (line,) = _problems("dev", short)
    assert line.startswith("config error: autoscaling.cluster.max_node_provision_time: 120 s is shorter")
    assert duration_seconds("15m") == 900


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_committed_stacks_keep_every_timeout_above_the_budget(stack: str) -> None:
    cfg = stack_config(stack)
    for model in cfg.models:
        budget = cold_start_budget(cfg, model)
        assert cfg.ray.cold_start.engine_start_seconds >= budget.in_container
        # KubeRay's liveness probe checks the raylet, which is up after Ray start, not after the engine.
        assert cold_start.figure("kuberay_liveness_window") >= budget.ray_start + budget.serve_ready


def test_the_render_command_refuses_a_short_engine_start_timeout_in_one_line(tmp_path: Path) -> None:
    doc = stack_doc("dev")
    doc["config"].setdefault(f"{NS}ray", {})["cold_start"] = {"engine_start_seconds": 100}
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = render_cli("--stack", "dev", "--config", str(path), "--out", str(tmp_path / "out"))
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "config error: ray.cold_start.engine_start_seconds: 100 s is shorter than the cold-start budget of "
        "'llama-31-8b' on g6.2xlarge"
    )
    assert not (tmp_path / "out").exists()


def test_capacity_page_shows_the_current_budgets_of_the_example_stacks() -> None:
    from infra.render import ROOT

    page = (ROOT / "docs" / "capacity.md").read_text()
    section = page.split("\n## The cold-start budget\n", 1)[1].split("\n## ", 1)[0]
    for stack in ("dev", "prod"):
        cfg = stack_config(stack)
        for model in cfg.models:
            assert f"    {cold_start_line(cold_start_budget(cfg, model))}\n" in section, (stack, model.name)
