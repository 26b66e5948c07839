"""The twin's trace check: one request, named by its client, arrives as spans at the OTLP receiver.

The twin deploys with every catalogue's ``tracing.otlp_endpoint`` pointing at
a local :class:`~localserve.otlp.OtlpReceiver` (``twin.deploy.with_tracing``).
:func:`check_traces` then sends one chat completion with an ``X-Request-Id``
it chose and waits for vLLM's ``llm_request`` span of that request: vLLM 0.29
takes the header as the request id's base (``chatcmpl-<X-Request-Id>`` for a
chat completion) and writes it to the span's ``gen_ai.request.id``. Under
serve-ingress, Serve's proxy keeps the header as Serve's request id and Serve
LLM hands it to vLLM the same way, so one check serves both layouts. Serve's
replica spans of the request (``route_to_replica``, ``replica_handle_request``)
carry it as ``request_id`` and are named on the line too; they are a trace of
their own, as Serve LLM does not pass its span context on to vLLM.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from localserve.otlp import OtlpReceiver, ReceivedSpan
from localserve.traffic import quiet_http_client_logs
from twin.report import Report

# vLLM's span of a finished request and its request-id attribute (vllm/tracing/utils.py SpanAttributes).
VLLM_REQUEST_SPAN = "llm_request"
REQUEST_ID_ATTRIBUTE = "gen_ai.request.id"
REQUEST_ID_HEADER = "X-Request-Id"
# Serve's replica spans (serve-ingress) carry Serve's request id, which its proxy takes from the header.
SERVE_REQUEST_ID = "request_id"
# vLLM's BatchSpanProcessor flushes every 5 s; a busy two-core machine needs more.
SPAN_TIMEOUT_S = 30.0
# Serve's spans of the same request may arrive a flush after vLLM's.
SETTLE_S = 6.0


def request_id() -> str:
    """A request id no other request of the run carries."""
    return "twin-trace-" + secrets.token_hex(8)


def of_request(rid: str) -> Callable[[ReceivedSpan], bool]:
    """Whether a span carries request ``rid``: vLLM's prefixed (``chatcmpl-<rid>``) or Serve's as it is."""

    def matches(span: ReceivedSpan) -> bool:
        value = span.attributes.get(REQUEST_ID_ATTRIBUTE)
        return (isinstance(value, str) and value.endswith(rid)) or span.attributes.get(SERVE_REQUEST_ID) == rid

    return matches


def chat_sender(base_url: str, api_key: str, model_id: str, timeout_s: float = 120.0) -> Callable[[str], None]:
    """``send_chat`` for :func:`check_traces`: one short chat completion at an OpenAI base URL, with the id header."""

    def send(rid: str) -> None:
        import openai

        quiet_http_client_logs()
        client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
            temperature=0,
            extra_headers={REQUEST_ID_HEADER: rid},
        )

    return send


def _names(spans: list[ReceivedSpan]) -> str:
    return ", ".join(sorted({s.name for s in spans})) or "none"


def check_traces(
    report: Report,
    service_name: str,
    receiver: OtlpReceiver,
    send_chat: Callable[[str], None],
    timeout_s: float = SPAN_TIMEOUT_S,
    settle_s: float = SETTLE_S,
) -> bool:
    """Sends one chat with a fresh ``X-Request-Id`` and checks vLLM's span of it reached ``receiver``.

    One PASS/FAIL line naming the request id, the span names of that request
    and every span name received while it ran; returns whether it passed.
    ``settle_s``: how long to wait on, after vLLM's span, for Serve's spans.
    """
    rid = request_id()
    seen_before = len(receiver.spans())
    try:
        send_chat(rid)
    except Exception as err:
        return report.check(service_name, False, f"traces: the chat with {REQUEST_ID_HEADER} {rid} failed: {err}")
    found = receiver.wait_for(lambda s: of_request(rid)(s) and s.name == VLLM_REQUEST_SPAN, timeout_s)
    if found and settle_s > 0:
        # Serve's spans of the request come from other processes and flushes: give them a moment.
        receiver.wait_for(lambda _s: False, settle_s)
    spans = receiver.spans()[seen_before:]
    mine = [s for s in spans if of_request(rid)(s) or s.trace_id in {f.trace_id for f in found}]
    if found:
        span = found[0]
        return report.check(
            service_name,
            True,
            f"traces: request {rid} arrived at the OTLP receiver as {_names(mine)} "
            f"({REQUEST_ID_ATTRIBUTE} {span.attributes[REQUEST_ID_ATTRIBUTE]}, trace {span.trace_id[:8]}); "
            f"all spans received meanwhile: {_names(spans)}",
        )
    return report.check(
        service_name,
        False,
        f"traces: no {VLLM_REQUEST_SPAN} span with {REQUEST_ID_ATTRIBUTE} ending in {rid} within {timeout_s:.0f}s "
        f"at {receiver.endpoint}; received meanwhile: {_names(spans)}",
    )
