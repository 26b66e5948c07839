"""Traces, received: vLLM's own OpenAI server, started as a vllm-server replica starts it, sends its spans.

Fast on purpose (no Ray cluster): the replica class itself
(``inference_server.vllm_server.VllmServer``) starts ``vllm_main`` from a
catalogue whose ``tracing.otlp_endpoint`` is a local OTLP/gRPC receiver
(``localserve.otlp``), exactly the process a replica runs in production.
One chat completion with a client-chosen ``X-Request-Id`` must arrive as
vLLM's ``llm_request`` span carrying that id. Serve's own tracing of the
serve-ingress layout is checked by the twin (twin/traces.py) and, without a
cluster, by tests/test_tracing.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from localserve.otlp import OtlpReceiver
from localserve.processes import child_env
from localserve.server import MODEL_ID, catalog_for, write_keys
from twin.report import Report
from twin.traces import REQUEST_ID_ATTRIBUTE, VLLM_REQUEST_SPAN, chat_sender, check_traces, of_request

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = "240"
# The OpenTelemetry SDK's batch processor flushes every 5 s by default; sooner here, to keep the test short.
FAST_FLUSH = {"OTEL_BSP_SCHEDULE_DELAY": "200"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


@pytest.fixture(scope="module")
def traced_server(tiny_model: Path, e2e_dir: Path, receiver: OtlpReceiver) -> Iterator[dict[str, Any]]:
    """One vllm-server replica's vLLM server (no Serve around it), tracing to ``receiver``."""
    from inference_server.vllm_server import VllmServer

    work = e2e_dir / "tracing"
    work.mkdir(exist_ok=True)
    api_key = write_keys(work / "keys")
    catalog = catalog_for(tiny_model, work / "keys", layout="vllm-server")
    catalog["vllm_server"] = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "drain_notice_s": 0}
    # Stopping is a SIGTERM at once: no drain to wait for.
    catalog["shutdown"] = {"timeout_s": 0, "wait_loop_s": 0}
    catalog["tracing"] = {"otlp_endpoint": receiver.endpoint}
    started = time.monotonic()
    # The replica passes its own environment on: the local run's (workloads on the path, loopback only).
    with mock.patch.dict(
        os.environ, child_env({"INFERENCE_VLLM_START_TIMEOUT_S": START_TIMEOUT_S, **FAST_FLUSH}), clear=True
    ):
        server = VllmServer(catalog)
    print(f"\n[e2e] traced vLLM server ready in {time.monotonic() - started:.1f}s", flush=True)
    try:
        yield {"url": server.url, "api_key": api_key}
    finally:
        # What Serve calls when it stops a replica.
        server.__del__()


def test_a_request_arrives_as_vllms_span_with_the_clients_request_id(
    traced_server: dict[str, Any], receiver: OtlpReceiver
) -> None:
    report = Report()
    send = chat_sender(traced_server["url"], traced_server["api_key"], MODEL_ID)
    # No Serve around this server: nothing else to wait for once vLLM's span is in.
    assert check_traces(report, "tracing-e2e", receiver, send, settle_s=0), report.failed
    spans = [s for s in receiver.spans() if s.name == VLLM_REQUEST_SPAN]
    rid = spans[-1].attributes[REQUEST_ID_ATTRIBUTE]
    # vLLM's id of a chat completion: chatcmpl-<the client's X-Request-Id>.
    assert str(rid).startswith("chatcmpl-twin-trace-"), rid
    assert of_request(str(rid).removeprefix("chatcmpl-"))(spans[-1])
    span = spans[-1]
    assert span.attributes["gen_ai.usage.prompt_tokens"] > 0
    assert span.attributes["gen_ai.usage.completion_tokens"] > 0
    assert span.resource.get("vllm.instrumenting_module_name") == "vllm.llm_engine"
