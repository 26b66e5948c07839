"""Traces, declared: `observability.tracing` from the stack file to vLLM, Serve and the NetworkPolicies.

The live half (spans received from a real vLLM server) is
tests/e2e/test_tracing_e2e.py; the twin checks a rendered RayService
(twin/traces.py).
"""

from __future__ import annotations

import copy
import io
import os
import time
from collections.abc import Iterator
from functools import cache
from typing import Any
from unittest import mock

import pytest
import yaml

from infra.config import ConfigError, StackConfig, parse
from infra.render import Rendered
from localserve.otlp import OtlpReceiver
from tests.harness import SERVE_INGRESS, STACKS, manifests_of, render_config, render_stack, stack_doc, stack_sections
from twin import serve_app
from twin.deploy import with_tracing
from twin.report import Report
from twin.traces import REQUEST_ID_ATTRIBUTE, VLLM_REQUEST_SPAN, check_traces
from workloads.inference_server.catalog import Catalog
from workloads.inference_server.engine import (
    SERVE_OTLP_ENDPOINT_ENV,
    SERVE_TRACING_EXPORTER,
    engine_kwargs,
    ingress_deployment_config,
    llm_config_kwargs,
)

COLLECTOR = "http://otel-collector.monitoring:4317"
KEY = "llm-platform:observability"


def _with_tracing(config: dict[str, Any], tracing: dict[str, Any]) -> None:
    config[KEY] = {**(config.get(KEY) or {}), "tracing": tracing}


def problems(stack: str, tracing: dict[str, Any]) -> list[str]:
    raw = stack_sections(stack, lambda c: _with_tracing(c, tracing))
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return [str(p) for p in info.value.problems]


def accepted(stack: str, tracing: dict[str, Any]) -> StackConfig:
    return parse(stack_sections(stack, lambda c: _with_tracing(c, tracing)))


# --- the config rule ---------------------------------------------------------------------------

RULE = "must be http://host:port, https://host:port or grpc://host:port (the collector's OTLP/gRPC port, e.g. 4317)"


@pytest.mark.parametrize(
    "endpoint",
    [
        "otel-collector:4317",  # no scheme
        "tcp://otel-collector:4317",
        "http://otel-collector",  # no port
        "http://:4317",  # no host
        "http://otel-collector:99999",
        "http://otel-collector:port",
        "",
    ],
)
def test_a_bad_endpoint_is_one_line_naming_the_key_and_the_rule(endpoint: str) -> None:
    assert problems("dev", {"otlp_endpoint": endpoint}) == [
        f"config error: observability.tracing.otlp_endpoint: '{endpoint}' {RULE}"
    ]


@pytest.mark.parametrize(
    "endpoint", ["http://collector:4318/v1/traces", "http://user:secret@collector:4317", "http://collector:4317?x=1"]
)
def test_a_path_query_or_credentials_are_refused(endpoint: str) -> None:
    assert problems("prod", {"otlp_endpoint": endpoint}) == [
        f"config error: observability.tracing.otlp_endpoint: '{endpoint}' {RULE}, with no path, query or credentials"
    ]


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_the_sample_ratio_is_a_share(ratio: float) -> None:
    (line,) = problems("dev", {"otlp_endpoint": COLLECTOR, "sample_ratio": ratio})
    assert line.startswith("config error: observability.tracing.sample_ratio: Input should be")


def test_an_unknown_key_is_refused() -> None:
    assert problems("dev", {"endpoint": COLLECTOR}) == [
        "config error: observability.tracing.endpoint: unknown key",
    ]


@pytest.mark.parametrize(
    ("endpoint", "port"),
    [(COLLECTOR, 4317), ("https://otlp.example.com:443/", 443), ("grpc://10.0.3.7:14317", 14317)],
)
def test_good_endpoints_are_accepted(endpoint: str, port: int) -> None:
    tracing = accepted("prod", {"otlp_endpoint": endpoint, "sample_ratio": 0.25}).observability.tracing
    assert (tracing.otlp_endpoint, tracing.sample_ratio, tracing.port, tracing.enabled) == (endpoint, 0.25, port, True)


@pytest.mark.parametrize("stack", STACKS)
def test_tracing_is_off_by_default_and_no_stack_names_a_collector(stack: str) -> None:
    tracing = parse(stack_sections(stack)).observability.tracing
    assert tracing.otlp_endpoint is None and not tracing.enabled and tracing.port is None
    assert "tracing" not in (stack_doc(stack)["config"].get(KEY) or {})


# --- the render ------------------------------------------------------------------------------


@cache
def traced(stack: str) -> Rendered:
    doc = copy.deepcopy(stack_doc(stack))
    _with_tracing(doc["config"], {"otlp_endpoint": COLLECTOR, "sample_ratio": 0.5})
    return render_config(doc, stack)


def serve_configs(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {
        rs["metadata"]["name"]: yaml.safe_load(rs["spec"]["serveConfigV2"])
        for rs in manifests_of(rendered, "RayService")
    }


def _layout(config: dict[str, Any]) -> str:
    return str(config["applications"][0]["args"].get("layout", "serve-ingress"))


@pytest.mark.parametrize("stack", STACKS)
def test_without_tracing_nothing_is_rendered(stack: str) -> None:
    for name, config in serve_configs(render_stack(stack)).items():
        assert "tracing_config" not in config, name
        args = config["applications"][0]["args"]
        assert "tracing" not in args, name
        catalog = Catalog.model_validate(args)
        for entry in catalog.models:
            assert "otlp_traces_endpoint" not in engine_kwargs(entry, catalog)
        assert "runtime_env" not in ingress_deployment_config(catalog).get("ray_actor_options", {})
    for policy in manifests_of(render_stack(stack), "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            assert {"port": 4317, "protocol": "TCP"} not in rule.get("ports", []), policy["metadata"]["name"]


@pytest.mark.parametrize("stack", STACKS)
def test_both_layouts_give_vllm_the_endpoint_as_its_own_option(stack: str) -> None:
    configs = serve_configs(traced(stack))
    assert configs
    for name, config in configs.items():
        args = config["applications"][0]["args"]
        assert args["tracing"] == {"otlp_endpoint": COLLECTOR, "sample_ratio": 0.5}, name
        catalog = Catalog.model_validate(args)
        for entry in catalog.models:
            # serve-ingress: Serve LLM's engine_kwargs; vllm-server: the replica's vllm_main spec.
            assert engine_kwargs(entry, catalog)["otlp_traces_endpoint"] == COLLECTOR, name


def test_the_serve_ingress_layout_traces_serve_too() -> None:
    configs = {n: c for n, c in serve_configs(traced(SERVE_INGRESS)).items() if _layout(c) == "serve-ingress"}
    assert configs, "dev's serve-ingress variant serves in that layout"
    for name, config in configs.items():
        assert config["tracing_config"] == {
            "enabled": True,
            "exporter_import_path": SERVE_TRACING_EXPORTER,
            "sampling_ratio": 0.5,
        }, name
        catalog = Catalog.model_validate(config["applications"][0]["args"])
        ingress = ingress_deployment_config(catalog)["ray_actor_options"]
        assert ingress["runtime_env"] == {"env_vars": {SERVE_OTLP_ENDPOINT_ENV: COLLECTOR}}
        assert ingress["resources"] == {catalog.ingress_resource: 1}
        for entry in catalog.models:
            env = llm_config_kwargs(entry, catalog)["runtime_env"]["env_vars"]
            assert env[SERVE_OTLP_ENDPOINT_ENV] == COLLECTOR
            assert env["HF_HUB_OFFLINE"] == "1"  # the replica's own environment stays


def test_the_vllm_server_layout_has_no_serve_tracing() -> None:
    configs = {n: c for n, c in serve_configs(traced("prod")).items() if _layout(c) == "vllm-server"}
    assert configs, "prod serves in the vllm-server layout"
    for name, config in configs.items():
        # No request passes through Serve there: vLLM's span is the request's.
        assert "tracing_config" not in config, name


@pytest.mark.parametrize("stack", STACKS)
def test_rays_schema_reads_the_traced_serve_config(stack: str) -> None:
    schema = pytest.importorskip("ray.serve.schema", reason="ray[serve]==2.60.0 is not installed")
    for config in serve_configs(traced(stack)).values():
        parsed = schema.ServeDeploySchema.model_validate(config)
        if "tracing_config" in config:
            assert parsed.tracing_config is not None
            assert parsed.tracing_config.exporter_import_path == SERVE_TRACING_EXPORTER


@pytest.mark.parametrize("stack", STACKS)
def test_the_ray_pods_may_reach_the_collectors_port(stack: str) -> None:
    rendered = traced(stack)
    services = set(serve_configs(rendered))
    opened = {}
    for policy in manifests_of(rendered, "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            if {"port": 4317, "protocol": "TCP"} in rule.get("ports", []):
                opened[policy["metadata"]["name"]] = rule
    # Every pod of each RayService (the `<service>-ray` policy), to any address on that port only.
    assert set(opened) == {f"{s}-ray" for s in services}
    for rule in opened.values():
        assert rule == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 4317}]}


def test_vllm_main_sets_the_endpoint_on_vllms_parsed_arguments() -> None:
    pytest.importorskip("vllm")
    from inference_server.catalog import Catalog as ServerCatalog
    from inference_server.engine import engine_kwargs as server_engine_kwargs
    from inference_server.vllm_main import server_args

    config = next(c for c in serve_configs(traced("prod")).values() if _layout(c) == "vllm-server")
    catalog = ServerCatalog.model_validate(config["applications"][0]["args"])
    spec = {
        "model": "/models/m",
        "served_model_name": "m",
        "host": "127.0.0.1",
        "port": 8100,
        "engine_kwargs": server_engine_kwargs(catalog.models[0], catalog),
    }
    assert server_args(spec).otlp_traces_endpoint == COLLECTOR


def test_engine_overrides_can_not_set_the_endpoint_a_second_way() -> None:
    doc = serve_configs(render_stack("dev"))
    args = copy.deepcopy(next(iter(doc.values()))["applications"][0]["args"])
    args["models"][0]["engine_overrides"] = {"otlp_traces_endpoint": COLLECTOR}
    with pytest.raises(ValueError, match=r"must not set \['otlp_traces_endpoint'\]"):
        Catalog.model_validate(args)


# --- Serve's exporter and the receiver ---------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def _export(endpoint: str, name: str, attributes: dict[str, Any]) -> None:
    """One span through the OTel SDK's OTLP/gRPC exporter, as vLLM sends it."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from workloads.inference_server.tracing import otlp_exporter

    provider = TracerProvider(resource=Resource.create({"service.name": "unit", "vllm.process_id": "7"}))
    provider.add_span_processor(SimpleSpanProcessor(otlp_exporter(endpoint)))
    with provider.get_tracer("unit").start_as_current_span(name, attributes=attributes):
        pass
    provider.shutdown()


def test_the_receiver_keeps_spans_with_plain_attributes(receiver: OtlpReceiver) -> None:
    _export(receiver.endpoint, "llm_request", {"gen_ai.request.id": "chatcmpl-x", "n": 2, "f": 0.5, "ok": True})
    (span,) = receiver.wait_for(lambda s: s.name == "llm_request", 10)
    assert span.attributes == {"gen_ai.request.id": "chatcmpl-x", "n": 2, "f": 0.5, "ok": True}
    assert span.resource["service.name"] == "unit" and span.resource["vllm.process_id"] == "7"
    assert len(span.trace_id) == 32 and span.scope == "unit"
    started = time.monotonic()
    assert receiver.wait_for(lambda s: s.name == "never", 0.3) == []
    assert time.monotonic() - started < 5


def test_serves_exporter_passes_rays_checks_and_reaches_the_collector(receiver: OtlpReceiver) -> None:
    tracing_utils = pytest.importorskip("ray.serve._private.tracing_utils")
    from opentelemetry.sdk.trace import TracerProvider

    from workloads.inference_server import tracing

    with mock.patch.dict(os.environ, {SERVE_OTLP_ENDPOINT_ENV: receiver.endpoint}):
        tracing_utils._validate_tracing_exporter(tracing.serve_span_processors)
        processors = tracing.serve_span_processors()
    tracing_utils._validate_tracing_exporter_processors(processors)
    # What Ray does with them (setup_tracing), on a provider of our own.
    provider = TracerProvider()
    for processor in processors:
        provider.add_span_processor(processor)
    with provider.get_tracer("serve").start_as_current_span("proxy_http_request"):
        pass
    provider.shutdown()  # flushes the batch
    assert receiver.wait_for(lambda s: s.name == "proxy_http_request", 10)


def test_serves_exporter_without_an_endpoint_exports_nothing() -> None:
    from workloads.inference_server import tracing

    with mock.patch.dict(os.environ, clear=False):
        os.environ.pop(SERVE_OTLP_ENDPOINT_ENV, None)
        assert tracing.serve_span_processors() == []


# --- the twin's substitution and check ---------------------------------------------------------


def _twin_config(rendered: dict[str, Any]) -> dict[str, Any]:
    """A serve config as twin_serve_config leaves it: the catalogue nested under the twin's builder."""
    config = copy.deepcopy(rendered)
    for app in config["applications"]:
        app["args"] = {"import_path": app["import_path"], "args": app["args"], "placement_group_configs": {}}
        app["import_path"] = serve_app.IMPORT_PATH
    return config


@pytest.mark.parametrize("stack", STACKS)
def test_with_tracing_points_every_catalogue_at_the_receiver(stack: str) -> None:
    for rendered in serve_configs(render_stack(stack)).values():
        config = _twin_config(rendered)
        line = with_tracing(config, "http://127.0.0.1:43170")
        assert line.startswith("tracing.otlp_endpoint none -> http://127.0.0.1:43170 (the twin's OTLP receiver)")
        catalog = Catalog.model_validate(config["applications"][0]["args"]["args"])
        assert catalog.tracing.otlp_endpoint == "http://127.0.0.1:43170" and catalog.tracing.sample_ratio == 1
        if _layout(rendered) == "serve-ingress":
            assert config["tracing_config"]["sampling_ratio"] == 1.0
            assert "Serve's tracing_config" in line
        else:
            assert "tracing_config" not in config


def test_with_tracing_names_the_stacks_collector_it_replaces() -> None:
    rendered = next(iter(serve_configs(traced("dev")).values()))
    line = with_tracing(copy.deepcopy(rendered), "http://127.0.0.1:43170")
    assert line.startswith(f"tracing.otlp_endpoint {COLLECTOR} -> http://127.0.0.1:43170")


def _llm_request(receiver: OtlpReceiver) -> Any:
    """What a serve-ingress request sends: Serve's replica span (its own trace) and vLLM's."""

    def send(rid: str) -> None:
        _export(receiver.endpoint, "replica_handle_request LLMServer:m chat", {"request_id": rid})
        _export(receiver.endpoint, "replica_handle_request LLMServer:m chat", {"request_id": "someone-else"})
        _export(receiver.endpoint, VLLM_REQUEST_SPAN, {REQUEST_ID_ATTRIBUTE: f"chatcmpl-{rid}"})

    return send


def test_check_traces_passes_on_the_requests_span_and_names_serves(receiver: OtlpReceiver) -> None:
    out = io.StringIO()
    report = Report(out=out)
    assert check_traces(report, "svc", receiver, _llm_request(receiver), timeout_s=10, settle_s=0.2)
    assert report.passed == 1 and not report.failed
    line = out.getvalue()
    assert line.startswith("PASS [svc] traces: request twin-trace-")
    assert "arrived at the OTLP receiver as llm_request, replica_handle_request LLMServer:m chat (" in line


def test_check_traces_fails_naming_what_arrived(receiver: OtlpReceiver) -> None:
    def other(_rid: str) -> None:
        _export(receiver.endpoint, "AsyncMPClient init", {})

    report = Report(out=io.StringIO())
    assert not check_traces(report, "svc", receiver, other, timeout_s=1, settle_s=0)
    (line,) = report.failed
    assert "no llm_request span with gen_ai.request.id ending in twin-trace-" in line
    assert "received meanwhile: AsyncMPClient init" in line


def test_check_traces_fails_when_the_request_fails(receiver: OtlpReceiver) -> None:
    def broken(_rid: str) -> None:
        raise ConnectionError("refused")

    report = Report(out=io.StringIO())
    assert not check_traces(report, "svc", receiver, broken, timeout_s=1)
    assert "failed: refused" in report.failed[0]
