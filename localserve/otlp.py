"""A local OTLP/gRPC trace receiver: what a collector would get from vLLM and Ray Serve, kept in memory.

Used by the twin (twin/traces.py) and the end-to-end tests. vLLM 0.29 exports
its spans over OTLP/gRPC (its default; OTLP/HTTP only when
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, which nothing here sets)
and so does the platform's Serve exporter (inference_server.tracing), so gRPC
is the one protocol served. The server runs in this process, in gRPC's own
threads, on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from localserve.processes import free_port

LOOPBACK = "127.0.0.1"
# A bound port that was taken between free_port() and the bind: try another.
BIND_ATTEMPTS = 5


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value (lists and dicts for arrays and key-value lists)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key-value pairs as a dict."""
    return {pair.key: any_value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it, ids in hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    received_at: float = field(default_factory=time.monotonic)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(  # noqa: N802 - the gRPC method's name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes=attributes(span.attributes),
                            resource=resource,
                            scope=scope_spans.scope.name,
                        )
                    )
        self._sink(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC TraceService on 127.0.0.1 that keeps every span it receives.

    ``start()`` binds a free port; :attr:`endpoint` is then what vLLM's
    ``--otlp-traces-endpoint`` (or the catalogue's ``tracing.otlp_endpoint``)
    takes. Usable as a context manager.
    """

    def __init__(self, host: str = LOOPBACK) -> None:
        self.host = host
        self.port: int | None = None
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        """The OTLP/gRPC endpoint, plaintext (``http://127.0.0.1:<port>``)."""
        if self.port is None:
            raise RuntimeError("the OTLP receiver is not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpReceiver:
        """Binds a free port and serves until :meth:`stop`."""
        if self._server is not None:
            return self
        for _ in range(BIND_ATTEMPTS):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-receiver"))
            add_servicer = trace_service_pb2_grpc.add_TraceServiceServicer_to_server
            add_servicer(_TraceService(self._add), server)  # type: ignore[no-untyped-call]
            port = free_port()
            try:
                bound = server.add_insecure_port(f"{self.host}:{port}")
            except RuntimeError:
                bound = 0
            if bound == port:
                server.start()
                self._server, self.port = server, port
                return self
            server.stop(None)
        raise RuntimeError(f"the OTLP receiver found no free port on {self.host} in {BIND_ATTEMPTS} attempts")

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (the spans received stay readable)."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._changed:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[ReceivedSpan], bool], timeout_s: float) -> list[ReceivedSpan]:
        """The spans that satisfy ``predicate``, once there is one, or an empty list after ``timeout_s``.

        Exporters batch: a span arrives a few seconds after its request ended
        (vLLM's and Serve's BatchSpanProcessor flush every 5 s by default).
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = [s for s in self._spans if predicate(s)]
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return found
                self._changed.wait(left)
