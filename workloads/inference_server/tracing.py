"""Ray Serve's span exporter: OTLP/gRPC to the catalogue's collector.

serveConfigV2's ``tracing_config.exporter_import_path`` names
:func:`serve_span_processors` (see ``engine.serve_tracing_config``). Ray 2.60
calls it in every Serve replica it starts, with no arguments, and installs the
span processors it returns on the tracer provider it sets up (its sampler is
the config's ``sampling_ratio``); so the collector's address comes from the
replica's environment, which the catalogue sets (``engine.serve_tracing_env``).

vLLM exports its own spans (``otlp_traces_endpoint``). In a Serve LLM model
replica Serve sets the process' global tracer provider as the replica
starts, before vLLM's engine tries to, so vLLM's ``llm_request`` span goes
through Serve's (its sampler, these processors, the same collector).

The OpenTelemetry SDK and OTLP exporters ship with vLLM 0.29 (hard
dependencies) and with Ray's ``serve`` extra; the image's build imports this
module, so a base image without them fails there.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .engine import SERVE_OTLP_ENDPOINT_ENV

logger = logging.getLogger(__name__)


def otlp_exporter(endpoint: str) -> OTLPSpanExporter:
    """An OTLP/gRPC span exporter for ``endpoint``; TLS for https://, plaintext otherwise (as vLLM's exporter)."""
    # The exporter alone would take grpc:// for TLS (it reads only http:// as plaintext).
    return OTLPSpanExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme != "https")


def serve_span_processors() -> list[Any]:
    """Ray Serve's exporter hook: a batching OTLP/gRPC processor for the collector in the environment.

    Batching keeps the export off the request path. Without the variable
    (a replica started by hand) no spans leave the process.
    """
    endpoint = os.environ.get(SERVE_OTLP_ENDPOINT_ENV)
    if not endpoint:
        logger.warning("Serve tracing is on but $%s is not set: no spans are exported", SERVE_OTLP_ENDPOINT_ENV)
        return []
    return [BatchSpanProcessor(otlp_exporter(endpoint))]
