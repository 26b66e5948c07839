"""The stack-file rules in detail: variants of each broken-file class, and the values they share with other layers.

tests/test_config_files.py proves each class through the render command;
this file checks the edges in-process (fast) and that the numbers the rules
use are the ones the layers that build the resources use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from infra.aws import network
from infra.config import (
    ARN_RULES,
    Batch,
    ConfigError,
    StackConfig,
    cron_problem,
    load_stack_file,
    parse,
    quantity_value,
    read_stack_file,
    timezone_problem,
    vllm_server_problem,
)
from infra.render import ROOT
from infra.serving import batch as serving_batch
from tests.harness import stack_sections

NS = "llm-platform:"


def problems(stack: str, change: typing.Callable[[dict[str, Any]], None]) -> list[str]:
    raw = stack_sections(stack)
    change(raw)
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return [str(p) for p in info.value.problems]


def accepted(stack: str, change: typing.Callable[[dict[str, Any]], None]) -> StackConfig:
    raw = stack_sections(stack)
    change(raw)
    return parse(raw)


# ---------------------------------------------------------------- cron and time zones


@pytest.mark.parametrize(
    "expression",
    ["30 7 * * 1-5", "0 11 * * MON-FRI", "*/15 0-6,22-23 1,15 jan-mar,dec sun", "5/10 * ? * *", "0 0 31 12 6"],
)
def test_cron_expressions_keda_accepts(expression: str) -> None:
    assert cron_problem(expression) is None


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("60 7 * * 1-5", "minute 60 is outside 0-59"),
        ("0 7 0 * *", "day of month 0 is outside 1-31"),
        ("0 7 * 13 *", "month 13 is outside 1-12"),
        # KEDA's cron parser counts Sunday as 0 only.
        ("0 7 * * 7", "day of week 7 is outside 0-6"),
        ("0 7 * * fri-mon", "day of week range fri-mon runs backwards"),
        ("0 7 * * 1-5/0", "day of week step '0' is not a positive number"),
        ("0 7 * * weekdays", "day of week 'weekdays' is not a number or a name"),
        ("0 seven * * *", "hour 'seven' is not a number"),
    ],
)
def test_cron_fields_are_range_checked(expression: str, problem: str) -> None:
    assert cron_problem(expression) == f"'{expression}': {problem}"


def test_cron_needs_five_fields() -> None:
    assert cron_problem("0 7 * *") == (
        "'0 7 * *' is not a 5-field cron expression (minute hour day-of-month month day-of-week)"
    )


@pytest.mark.parametrize("name", ["UTC", "America/New_York", "Europe/Berlin", "Asia/Kolkata"])
def test_iana_time_zones_pass(name: str) -> None:
    assert timezone_problem(name) is None


@pytest.mark.parametrize("name", ["EST5", "Mars/Olympus", "", "../etc/passwd", "america/new_york "])
def test_other_time_zone_names_fail(name: str) -> None:
    assert (timezone_problem(name) or "").startswith(f"'{name}' is not an IANA time zone")


def test_time_zones_need_no_system_zone_files() -> None:
    """Slim images have no /usr/share/zoneinfo: the tzdata package (requirements.txt) answers instead."""
    assert any(line.startswith("tzdata==") for line in (ROOT / "requirements.txt").read_text().splitlines())
    env = {**os.environ, "PYTHONTZPATH": ""}
    code = (
        "import zoneinfo; assert zoneinfo.TZPATH == (), zoneinfo.TZPATH\n"
        "from pathlib import Path\n"
        "from infra.config import load_stack_file\n"
        "cfg = load_stack_file(Path('Pulumi.prod.yaml'))\n"
        "print(cfg.autoscaling.prescale[0].timezone)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "America/New_York"


# ---------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", Decimal(2)),
        ("500m", Decimal("0.5")),
        ("1.5", Decimal("1.5")),
        ("8Gi", Decimal(8 * 2**30)),
        ("512Mi", Decimal(512 * 2**20)),
        ("1e3", Decimal(1000)),
        ("1E", Decimal(10**18)),
        ("2k", Decimal(2000)),
        (".5", Decimal("0.5")),
        ("-1", Decimal(-1)),
    ],
)
def test_quantity_grammar(text: str, value: Decimal) -> None:
    assert quantity_value(text) == value


@pytest.mark.parametrize("text", ["", "8 Gi", "8GB", "8gi", "two", "1.2.3", "Gi", "1e", "0x10"])
def test_not_quantities(text: str) -> None:
    assert quantity_value(text) is None


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("head_cpu", "0", "'0' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)"),
        ("head_cpu", "2 cores", "'2 cores' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)"),
        ("head_memory", "-8Gi", "'-8Gi' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)"),
        (
            "head_memory",
            "512m",
            "'512m' is less than 1Mi of memory: 'm' is milli (a thousandth of a byte), 'Mi' is mebi",
        ),
    ],
)
def test_ray_head_quantities(key: str, value: str, problem: str) -> None:
    assert problems("dev", lambda raw: raw["ray"].update({key: value})) == [f"config error: ray.{key}: {problem}"]


def test_a_number_is_a_quantity_too() -> None:
    cfg = accepted("dev", lambda raw: raw["ray"].update(head_cpu=4, head_memory="16Gi"))
    assert cfg.ray.head_cpu == "4"


# ---------------------------------------------------------------- ARNs


def _arn_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field of the config schema named *_arn or *_arns, as a dotted path."""
    found: set[str] = set()
    hints = typing.get_type_hints(model)
    for name in model.model_fields:
        path = f"{prefix}{name}"
        if name.endswith(("_arn", "_arns")):
            found.add(path)
        for arg in (hints[name], *typing.get_args(hints[name])):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                found |= _arn_fields(arg, f"{path}.")
    return found


def test_every_arn_field_has_a_rule() -> None:
    assert _arn_fields(StackConfig) == set(ARN_RULES)


CERT = "arn:aws:acm:us-east-1:123456789012:certificate/3f1c2a8e-7b1d-4a55-9c0e-6d2f8b9a1c44"
KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@pytest.mark.parametrize(
    ("arn", "problem"),
    [
        (
            "arn:aws-cn:acm:us-east-1:123456789012:certificate/3f1c2a8e-7b1d-4a55-9c0e-6d2f8b9a1c44",
            "is in partition aws-cn, region us-east-1 in aws",
        ),
        (
            "arn:aws:iam::123456789012:server-certificate/llm",
            "is not arn:aws:acm:us-east-1:<account>:certificate/<id>",
        ),
        (CERT.replace("us-east-1", "eu-west-1"), "must name the stack's region us-east-1"),
        (CERT.replace("123456789012", ""), "names no account (arn:aws:acm:us-east-1:<account>:certificate/<id>)"),
        ("3f1c2a8e-7b1d-4a55-9c0e-6d2f8b9a1c44", "is not an ARN (arn:aws:acm:us-east-1:<account>:certificate/<id>)"),
    ],
)
def test_certificate_arns(arn: str, problem: str) -> None:
    assert problems("prod", lambda raw: raw["endpoint"].update(certificate_arn=arn)) == [
        f"config error: endpoint.certificate_arn: '{arn}' {problem}"
    ]


@pytest.mark.parametrize(
    ("arn", "problem"),
    [
        (
            "arn:aws:kms:us-east-1:123456789012:alias/ebs",
            "is not arn:aws:kms:us-east-1:<account>:key/<id>",
        ),
        (KEY.replace("us-east-1", "us-west-2"), "must name the stack's region us-east-1"),
    ],
)
def test_kms_key_arns(arn: str, problem: str) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["storage"]["storage_class"] = {"kms_key_arn": arn}

    assert problems("prod", change) == [f"config error: storage.storage_class.kms_key_arn: '{arn}' {problem}"]


def test_a_kms_key_of_the_region_passes() -> None:
    cfg = accepted("prod", lambda raw: raw["storage"].update(storage_class={"kms_key_arn": KEY}))
    assert cfg.storage.storage_class.kms_key_arn == KEY


@pytest.mark.parametrize(
    ("arn", "problem"),
    [
        ("arn:aws:sts::123456789012:assumed-role/admin/alice", "is not arn:aws:iam::<account>:role/<name>"),
        ("arn:aws:iam:us-east-1:123456789012:role/admin", "must name no region (the service is global)"),
        ("admin", "is not an ARN (arn:aws:iam::<account>:role/<name>)"),
    ],
)
def test_admin_principal_arns(arn: str, problem: str) -> None:
    good = "arn:aws:iam::123456789012:role/platform/admin"
    assert problems("prod", lambda raw: raw["cluster"].update(admin_principal_arns=[good, arn])) == [
        f"config error: cluster.admin_principal_arns[1]: '{arn}' {problem}"
    ]


def test_weights_writer_arns_are_users_or_roles() -> None:
    good = "arn:aws:iam::123456789012:role/ci/weights-upload"
    session = "arn:aws:sts::123456789012:assumed-role/weights-upload/alice"
    assert accepted("dev", lambda raw: raw["storage"].update(weights_writer_arns=[good])).storage.weights_writer_arns
    assert problems("dev", lambda raw: raw["storage"].update(weights_writer_arns=[good, session])) == [
        f"config error: storage.weights_writer_arns[1]: '{session}' is not arn:aws:iam::<account>:role/<name>"
    ]


# ---------------------------------------------------------------- allow-lists


@pytest.mark.parametrize(
    ("cidrs", "problem"),
    [
        # Two halves are the whole internet, whatever each looks like alone.
        (["0.0.0.0/1", "128.0.0.0/1"], "0.0.0.0/1, 128.0.0.0/1 is wider than /8 (name the clients' own ranges)"),
        (["0.0.0.0/0"], "0.0.0.0/0 is wider than /8 (name the clients' own ranges)"),
        (["198.51.100.0/24", "64.0.0.0/7"], "64.0.0.0/7 is wider than /8 (name the clients' own ranges)"),
        # Each range within the limit, together far beyond it.
        (
            [f"{n}.0.0.0/8" for n in (11, 12, 13)],
            "the ranges together admit 50331648 public addresses, more than one /8 (16777216): "
            "name the clients' own ranges",
        ),
    ],
)
def test_an_allow_list_as_wide_as_the_internet_is_refused(cidrs: list[str], problem: str) -> None:
    assert problems("prod", lambda raw: raw["endpoint"].update(allowed_cidrs=cidrs)) == [
        f"config error: endpoint.allowed_cidrs: {problem}"
    ]

    # The API server's public allow-list answers to the same rule.
    def public_api(raw: dict[str, Any]) -> None:
        raw["cluster"].update(endpoint_public_access=True, public_access_cidrs=cidrs)

    assert f"config error: cluster.public_access_cidrs: {problem}" in problems("dev", public_api)


def test_an_allow_list_of_client_ranges_passes() -> None:
    cidrs = ["11.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "198.51.100.0/24"]
    cfg = accepted("prod", lambda raw: raw["endpoint"].update(allowed_cidrs=cidrs))
    assert [str(c) for c in cfg.endpoint.allowed_cidrs] == cidrs


def test_a_plain_http_endpoint_admits_private_ranges_only() -> None:
    assert problems("dev", lambda raw: raw["endpoint"].update(allowed_cidrs=["10.20.0.0/16", "8.8.8.0/24"])) == [
        "config error: endpoint.allowed_cidrs: 8.8.8.0/24 is not a private range: without endpoint.certificate_arn "
        "the endpoint serves plain HTTP, and API keys must not cross public networks in clear"
    ]
    assert accepted("dev", lambda raw: raw["endpoint"].update(allowed_cidrs=["10.20.0.0/16"])).endpoint.allowed_cidrs


# ---------------------------------------------------------------- ElastiCache, VPC


@pytest.mark.parametrize("node_type", ["cache.t4g.micro", "cache.r7g.large", "cache.m7g.16xlarge", "cache.c7gn.xlarge"])
def test_elasticache_node_types(node_type: str) -> None:
    cfg = accepted("prod", lambda raw: raw["ray"]["gcs_fault_tolerance"].update(node_type=node_type))
    assert cfg.ray.gcs_fault_tolerance.node_type == node_type


@pytest.mark.parametrize(
    "node_type", ["r7g.large", "cache.t4g.large", "cache.r7g.small", "cache.r6gd.xlarge", "cache.m1.large", "redis"]
)
def test_not_elasticache_node_types(node_type: str) -> None:
    lines = problems("prod", lambda raw: raw["ray"]["gcs_fault_tolerance"].update(node_type=node_type))
    assert len(lines) == 1
    assert lines[0].startswith(f"config error: ray.gcs_fault_tolerance.node_type: '{node_type}' is not an")


def test_the_network_layer_cuts_subnets_as_the_rule_counts() -> None:
    """The VPC rule counts the masks infra/aws/network.py gives awsx."""
    from infra import config

    assert (network.PRIVATE_CIDR_MASK, network.PUBLIC_CIDR_MASK) == (
        config.PRIVATE_CIDR_MASK,
        config.PUBLIC_CIDR_MASK,
    )


@pytest.mark.parametrize(
    ("cidr", "zones", "ok"),
    [
        ("10.0.0.0/17", ["us-west-2a", "us-west-2b"], True),
        ("10.0.0.0/18", ["us-west-2a", "us-west-2b"], False),
        ("10.0.0.0/16", ["us-west-2a", "us-west-2b", "us-west-2c", "us-west-2d"], True),
        ("10.0.0.0/17", ["us-west-2a", "us-west-2b", "us-west-2c"], False),
    ],
)
def test_vpc_sizes(cidr: str, zones: list[str], ok: bool) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["network"].update(vpc_cidr=cidr, zones=zones)

    if ok:
        accepted("dev", change)
    else:
        (line,) = problems("dev", change)
        assert line.startswith(f"config error: network.vpc_cidr: {cidr} is too small for {len(zones)} zones")


def test_vpc_outside_what_aws_allows() -> None:
    assert problems("dev", lambda raw: raw["network"].update(vpc_cidr="10.0.0.0/8")) == [
        "config error: network.vpc_cidr: AWS allows a VPC from /16 to /28 (got 10.0.0.0/8)"
    ]


# ---------------------------------------------------------------- models, groups, batch


def test_tensor_parallel_must_divide_an_eight_gpu_node() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["node_groups"]["gpu"][1]["instance_types"] = ["g6e.48xlarge"]
        raw["models"][1]["tensor_parallel_size"] = 6

    assert problems("prod", change) == [
        "config error: models[1].tensor_parallel_size: 6 does not divide the 8 GPUs of g6e.48xlarge: use 1, 2, 4 "
        "or 8 (vLLM splits the attention heads over the TP ranks, and the models' head counts are powers of "
        "two; a TP group that does not divide a node also strands its other GPUs)"
    ]


def test_instance_types_sorted_after_the_first_too() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["node_groups"]["gpu"][0]["instance_types"] = ["g6e.2xlarge", "g6e.8xlarge", "g6e.4xlarge"]

    assert problems("prod", change) == [
        "config error: node_groups.gpu[0].instance_types: list the instance types of group 'l40s-1x' smallest "
        "first (g6e.2xlarge, g6e.4xlarge, g6e.8xlarge): the order is read as the sizes a group grows through"
    ]


def test_engine_overrides_take_frontend_arguments() -> None:
    """Ray Serve LLM hands vLLM's OpenAI frontend its own arguments (tool calling) from the same mapping."""

    def change(raw: dict[str, Any]) -> None:
        raw["models"][0]["engine_overrides"] = {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"}

    assert accepted("dev", change).models[0].engine_overrides["tool_call_parser"] == "llama3_json"


def test_a_name_far_from_any_argument_gets_no_suggestion() -> None:
    assert problems("dev", lambda raw: raw["models"][0].update(engine_overrides={"zzzz": 1})) == [
        "config error: models[0].engine_overrides.zzzz: not an engine argument of vLLM 0.29.0: Ray Serve LLM "
        "would refuse it when the replica starts"
    ]


def test_upgrade_headroom_counts_every_model_of_a_group() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["models"][0]["autoscaling"].update(min_replicas=5)

    assert problems("prod", change) == [
        "config error: node_groups.gpu[0].max_size: 10 leaves group 'l40s-1x' no room for a NewCluster upgrade at "
        "peak (ray.upgrade_headroom: peak): the old cluster at max_replicas and the new one at its starting replicas "
        "(initial_replicas, else min_replicas) need 'llama-31-8b' (8 + 5) x 1 = 13 GPUs = 13 g6e.2xlarge nodes; "
        "raise max_size to 13, or set ray.upgrade_headroom: min and accept that an upgrade started at peak waits "
        "for the old cluster to scale down"
    ]


def test_no_upgrade_headroom_without_new_cluster_upgrades() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["models"][0]["autoscaling"].update(min_replicas=5)
        raw["ray"]["upgrade_strategy"] = "None"

    accepted("prod", change)


@pytest.mark.parametrize("visibility", [60, 300, 900, 43200])
def test_the_worker_gets_the_request_timeout_the_rule_checks(visibility: int) -> None:
    settings = Batch(enabled=True, model="m", visibility_timeout_seconds=visibility)
    assert serving_batch.request_timeout_seconds(settings) == settings.request_timeout_seconds()


def test_batch_timeout_follows_the_limits() -> None:
    """A shorter max_tokens makes the same visibility timeout enough."""

    def change(raw: dict[str, Any]) -> None:
        raw["batch"]["visibility_timeout_seconds"] = 300
        raw["serving"]["limits"]["max_tokens"] = 2048

    assert accepted("prod", change).batch.request_timeout_seconds() == 270


# ---------------------------------------------------------------- the stack file itself


def _stack_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text(text)
    return path


def test_duplicate_keys_deep_in_a_section(tmp_path: Path) -> None:
    text = (ROOT / "Pulumi.prod.yaml").read_text()
    text = text.replace("        min_replicas: 2\n", "        min_replicas: 2\n        min_replicas: 0\n", 1)
    with pytest.raises(ConfigError) as info:
        read_stack_file(_stack_file(tmp_path, text))
    (problem,) = info.value.problems
    assert problem.path == "llm-platform:models[0].autoscaling.min_replicas"
    assert problem.message.startswith("duplicate key (lines ")


def test_duplicate_top_level_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        read_stack_file(_stack_file(tmp_path, "config:\n  aws:region: us-east-1\nconfig:\n  aws:region: x\n"))
    assert [str(p) for p in info.value.problems] == [
        "config error: config: duplicate key (lines 1 and 3): YAML would keep only the last, silently"
    ]


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        (
            "kubernetes:context",
            "unknown config namespace 'kubernetes': nothing reads it "
            "(the namespaces read are llm-platform, aws, docker-build, pulumi)",
        ),
        ("endpoint", "not a config key: Pulumi config keys are <namespace>:<name>"),
    ],
)
def test_keys_outside_the_namespaces_read(tmp_path: Path, key: str, problem: str) -> None:
    text = (ROOT / "Pulumi.dev.yaml").read_text() + f"  {key}: internal\n"
    with pytest.raises(ConfigError) as info:
        load_stack_file(_stack_file(tmp_path, text))
    assert [str(p) for p in info.value.problems] == [f"config error: {key}: {problem}"]


def test_engine_settings_are_a_known_namespace(tmp_path: Path) -> None:
    text = (ROOT / "Pulumi.dev.yaml").read_text() + "  pulumi:tags:\n    team: ml-platform\n"
    assert load_stack_file(_stack_file(tmp_path, text)).environment == "dev"


# ---------------------------------------------------------------- DNS


def test_a_domain_needs_its_hosted_zone() -> None:
    assert problems("prod", lambda raw: raw["endpoint"].pop("hosted_zone_id")) == [
        "config error: endpoint.hosted_zone_id: required with endpoint.domain: external-dns writes "
        "<service>.llm.example.com into that Route 53 zone "
        "(an existing cluster whose records are made elsewhere may switch platform.external_dns off)"
    ]


def test_records_made_elsewhere_need_no_zone() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["endpoint"].pop("hosted_zone_id")
        raw["cluster"].update(mode="existing", kubeconfig_context="ops")
        raw["ray"]["gcs_fault_tolerance"] = {"enabled": False}
        raw["platform"] = {"external_dns": {"enabled": False}}

    assert accepted("prod", change).endpoint.hosted_zone_id is None


def test_a_zone_without_a_domain_is_refused() -> None:
    assert problems("dev", lambda raw: raw["endpoint"].update(hosted_zone_id="Z0123456789EXAMPLEZONE")) == [
        "config error: endpoint.hosted_zone_id: set endpoint.domain too: the zone holds that domain's records"
    ]


# ---------------------------------------------------------------- serving layout


def _serving(raw: dict[str, Any], **values: Any) -> None:
    raw["serving"] = {**raw.get("serving", {}), **values}


PROD_INGRESS = {"min_replicas": 2, "max_replicas": 6}


def test_auto_picks_vllm_server_wherever_a_service_can_use_it() -> None:
    """One model, never at zero, one pod per replica: vllm-server; anything else: serve-ingress."""
    assert accepted("prod", lambda raw: None).layouts() == {"llama-31-8b": "vllm-server", "llama-33-70b": "vllm-server"}
    # Dev's model scales to zero: vllm-server only because the gateway wakes it.
    assert accepted("dev", lambda raw: None).layouts() == {"llama-31-8b": "vllm-server"}

    def no_gateway(raw: dict[str, Any]) -> None:
        raw["serving"].pop("gateway")
        raw["serving"].pop("routing")

    assert accepted("dev", no_gateway).layouts() == {"llama-31-8b": "serve-ingress"}

    def share(raw: dict[str, Any]) -> None:
        for model in raw["models"]:
            model["service"] = "shared"
        # An ingress then runs, and prod's rule for it applies.
        _serving(raw, ingress=PROD_INGRESS)

    assert accepted("prod", share).layouts() == {"shared": "serve-ingress"}
    cfg = accepted("prod", lambda raw: None)
    big = next(m for m in cfg.models if m.tensor_parallel_size == 4)
    assert cfg.layout_for([big]) == "vllm-server"
    assert cfg.layout_for([big.model_copy(update={"pipeline_parallel_size": 2})]) == "serve-ingress"

    # Without the gateway, held at one replica it goes direct.
    def held(raw: dict[str, Any]) -> None:
        no_gateway(raw)
        raw["models"][0]["autoscaling"].update(min_replicas=1, max_replicas=1)

    assert accepted("dev", held).layouts() == {"llama-31-8b": "vllm-server"}


def test_an_explicit_layout_applies_to_every_service() -> None:
    cfg = accepted("prod", lambda raw: _serving(raw, layout="serve-ingress", ingress=PROD_INGRESS))
    assert set(cfg.layouts().values()) == {"serve-ingress"} and cfg.uses_serve_ingress()
    # Prod in the serve-ingress layout with one ingress replica: a single point of failure.
    found = problems("prod", lambda raw: _serving(raw, layout="serve-ingress", ingress={"min_replicas": 1}))
    assert any("serving.ingress.min_replicas" in p for p in found), found
    cfg = accepted("prod", lambda raw: _serving(raw, layout="vllm-server"))
    assert set(cfg.layouts().values()) == {"vllm-server"} and not cfg.uses_serve_ingress()


def test_the_ingress_rules_hold_only_where_an_ingress_runs() -> None:
    """Prod's ingress settings are read by nothing once every service is vllm-server."""
    single = {"min_replicas": 1, "max_replicas": 2, "max_replicas_per_node": 2}
    assert not accepted("prod", lambda raw: _serving(raw, ingress=single)).uses_serve_ingress()
    found = problems("prod", lambda raw: _serving(raw, ingress=single, layout="serve-ingress"))
    assert [p.split(":")[1].strip() for p in found] == [
        "serving.ingress.min_replicas",
        "serving.ingress.max_replicas_per_node",
    ]


def test_the_layout_rules_are_the_servers_own() -> None:
    """What config refuses for vllm-server, the server's catalogue refuses too (and accepts the rest)."""
    from workloads.inference_server.catalog import Catalog

    cfg = accepted("prod", lambda raw: None)
    model = cfg.models[0]
    entry = {k: v for k, v in model.model_dump().items() if k in {"model_id", "source", "max_model_len"}}
    variants = {
        "fine": [model],
        "two": [model, cfg.models[1]],
        "at zero": [model.model_copy(update={"autoscaling": model.autoscaling.model_copy(update={"min_replicas": 0})})],
        "pipeline": [model.model_copy(update={"pipeline_parallel_size": 2})],
    }
    for name, models in variants.items():
        entries = [
            {
                **entry,
                "model_id": m.model_id,
                "pipeline_parallel_size": m.pipeline_parallel_size,
                "autoscaling": m.autoscaling.model_dump(),
            }
            for m in models
        ]
        # The catalogue can not see the gateway: its rules are the config's with a gateway to wake a model at zero.
        refused = vllm_server_problem(models, woken=True) is not None
        assert (vllm_server_problem(models) is not None) == (refused or name == "at zero"), name
        try:
            Catalog.model_validate({"models": entries, "layout": "vllm-server"})
        except ValueError:
            assert refused, name
        else:
            assert not refused, name
