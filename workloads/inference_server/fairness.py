"""Per-key fairness and attribution: in-flight caps, an access log line and token counters per API key.

:class:`KeyAccounting` is an ASGI middleware that runs outside the guard
(:class:`~inference_server.guard.ApiGuard`), in the same process, so it sees
every answer, the guard's refusals included. For each request it:

1. names the API key by its id (never the key: :mod:`.api_keys`);
2. on a generation route, lets the request in only while its key holds fewer
   than its cap and the replica fewer than its own (:class:`InflightLimiter`),
   and answers 429 with ``Retry-After`` and an OpenAI error body otherwise.
   The slot is taken before the body is read (a refused request costs a
   header parse) and held until the answer ends: for a stream, its last
   chunk, or the client going away (the app's call returns then);
3. writes one JSON line to the server's stderr (:class:`AccessLog`): request
   id, key id, model, status, prompt and output tokens, latency and time to
   the first byte; never a prompt, an answer or a key;
4. counts requests by status and prompt and generation tokens per key id and
   model (:class:`KeyMetrics`). Key ids come from the keys file and models
   from the catalogue, so the label sets stay as small as the config.

Where the token counts come from, most exact first:

* vLLM's own app (vllm-server) leaves each
  chat or completion request's ``final_usage_info`` in the request state
  (``RequestResponseMetadata``), for streams too;
* an answer that carries ``usage``: every non-streamed answer, and a stream
  whose client asked for ``stream_options.include_usage``;
* otherwise (a serve-ingress stream without usage, or a stream the client
  left before its end, where vLLM never reaches its usage) the prompt is not
  known and the output is counted as the stream's data events that carry
  choices: one per engine step and choice, so one per token unless the
  engine batches tokens into a chunk. The log line says ``"tokens":
  "counted"`` then, and such a count never feeds the prompt counter.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .catalog import KeyFairness
from .guard import (
    LIMITED_PATHS,
    OPEN_PATHS,
    RENDER_PATHS,
    ApiKeys,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    bearer_token,
    error_body,
    route_path,
    send_json,
)

# The metric names as Prometheus shows them in both layouts. Under
# serve-ingress Ray's metrics agent prefixes `ray_` to the names given to
# ray.util.metrics (as it does for vLLM's); under vllm-server the counters are
# registered on vLLM's own registry with the prefix written out, so the
# dashboards and rules read one name for both (counters end in `_total`).
METRIC_PREFIX = "ray_"
REQUESTS_METRIC = "llm_api_key_requests"
PROMPT_TOKENS_METRIC = "llm_api_key_prompt_tokens"
GENERATION_TOKENS_METRIC = "llm_api_key_generation_tokens"
METRIC_LABELS = ("key_id", "model", "status")
TOKEN_LABELS = ("key_id", "model")
# What a request id from a client may look like to be kept (else a new one is made).
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
REQUEST_ID_HEADER = b"x-request-id"
# Where the model name sits in an answer: vLLM and Serve LLM write `id`,
# `object`, `created`, then `model` first in every answer and stream chunk,
# so the head of the body holds it.
_MODEL_MARK = b'"model":'
MODEL_SCAN_BYTES = 4096
# `"usage":` with unescaped quotes is a key of the answer object: inside a
# JSON string every quote is escaped. Its object is a handful of integers.
_USAGE = re.compile(rb'"usage":\s*\{')
MAX_USAGE_BYTES = 4096
# Carried from one chunk to the next, so a mark split between two is found.
_CARRY_BYTES = 64
# A stream's chunks are held (references, not copies) until this many bytes
# of them wait, or until a count is asked for (AnswerReader); the unfinished
# event carried between batches is bounded. Most answers end below it, and
# vLLM's own usage then makes reading them unnecessary.
STREAM_HOLD_BYTES = 64 * 1024
MAX_EVENT_BYTES = 1 << 20
_STREAM_EVENT = b"data: {"
_EVENT_END = b"\n\n"
# A stream chunk that carries a choice (the usage-only chunk has `"choices":[]`),
# unless its text is empty: a chat stream's first chunk (the role) and, often,
# the one that only carries finish_reason.
_CHOICE_MARK = b'"index":'
_EMPTY_DELTA = re.compile(rb'"(?:content|text)":\s*""')
# Literals each pattern's match contains: an event without one can not match,
# and `in` on bytes costs a tenth of a pattern search. Nearly every event is
# a token's, with neither, so the per-token loop runs no pattern at all.
_USAGE_KEY = b'"usage":'
# One decoder for every answer: it holds no state between calls, and making one costs as much as its use.
_JSON = json.JSONDecoder()
_EMPTY_STRING = b'""'

Refused = Literal["key", "replica"]
TokenSource = Literal["exact", "counted", "none"]


class InflightLimiter:
    """Requests in flight per key id and in all, with a cap on each.

    Guarded by a lock: Serve may run a replica's ASGI app on a thread of its
    own, and the counts must never go negative or leak a slot.
    """

    def __init__(self, fairness: KeyFairness, replica_cap: int) -> None:
        if replica_cap < 1:
            raise ValueError(f"the replica's in-flight cap must be at least 1, not {replica_cap}")
        self.fairness = fairness
        self.replica_cap = replica_cap
        self._lock = threading.Lock()
        self._by_key: dict[str, int] = {}
        self._total = 0

    def acquire(self, key_id: str) -> Refused | None:
        """Take a slot for ``key_id``; which cap is full when none is free."""
        with self._lock:
            held = self._by_key.get(key_id, 0)
            if held >= self.fairness.cap_for(key_id):
                return "key"
            if self._total >= self.replica_cap:
                return "replica"
            self._by_key[key_id] = held + 1
            self._total += 1
            return None

    def release(self, key_id: str) -> None:
        """Give back a slot taken with :meth:`acquire`."""
        with self._lock:
            held = self._by_key.get(key_id, 0)
            if held <= 1:
                self._by_key.pop(key_id, None)
            else:
                self._by_key[key_id] = held - 1
            self._total = max(0, self._total - 1)

    def in_flight(self, key_id: str | None = None) -> int:
        """Requests in flight for ``key_id``, or in all."""
        with self._lock:
            return self._total if key_id is None else self._by_key.get(key_id, 0)


def too_many_requests(refused: Refused, key_id: str, cap: int, retry_after_s: int) -> bytes:
    """The 429 body, OpenAI-shaped; it names the key by its id, which the client's own key already tells it."""
    if refused == "key":
        message = (
            f"Too many requests in flight for API key '{key_id}' (at most {cap} at once on this replica). "
            f"Retry after {retry_after_s} s, or wait for your other requests to finish."
        )
        code = "too_many_requests_in_flight"
    else:
        message = f"The server is busy ({cap} requests in flight on this replica). Retry after {retry_after_s} s."
        code = "server_busy"
    return error_body(message, type_="rate_limit_error", param=None, code=code)


class KeyMetrics(Protocol):
    """Per-key counters: one call per finished request."""

    def observe(
        self, key_id: str, model: str, status: int, prompt_tokens: int | None, output_tokens: int | None
    ) -> None: ...


class PrometheusKeyMetrics:
    """The counters on a prometheus_client registry (vLLM's own under vllm-server, scraped on `vllm-metrics`)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        registry = REGISTRY if registry is None else registry
        self.requests = Counter(
            METRIC_PREFIX + REQUESTS_METRIC,
            "Requests answered, by API key id, model and HTTP status.",
            METRIC_LABELS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            METRIC_PREFIX + PROMPT_TOKENS_METRIC,
            "Prompt tokens of answered requests, by API key id and model.",
            TOKEN_LABELS,
            registry=registry,
        )
        self.generation_tokens = Counter(
            METRIC_PREFIX + GENERATION_TOKENS_METRIC,
            "Generated tokens, by API key id and model.",
            TOKEN_LABELS,
            registry=registry,
        )

        # Each label set's child, looked up once: `labels()` validates and locks
        # on every call. The sets are as few as the keys, the models and the
        # statuses answered (the module docstring).
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, counter: Any, *labels: str) -> Any:
        found = self._children.get((counter, *labels))
        if found is None:
            found = self._children[(counter, *labels)] = counter.labels(*labels)
        return found

    def observe(
        self, key_id: str, model: str, status: int, prompt_tokens: int | None, output_tokens: int | None
    ) -> None:
        self._child(self.requests, key_id, model, str(status)).inc()
        if prompt_tokens:
            self._child(self.prompt_tokens, key_id, model).inc(prompt_tokens)
        if output_tokens:
            self._child(self.generation_tokens, key_id, model).inc(output_tokens)


class RayKeyMetrics:
    """The counters through Ray's metrics agent (serve-ingress: the `metrics` port of every Ray pod)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter

        self.requests = Counter(
            REQUESTS_METRIC, "Requests answered, by API key id, model and HTTP status.", tag_keys=METRIC_LABELS
        )
        self.prompt_tokens = Counter(
            PROMPT_TOKENS_METRIC, "Prompt tokens of answered requests, by API key id and model.", tag_keys=TOKEN_LABELS
        )
        self.generation_tokens = Counter(
            GENERATION_TOKENS_METRIC, "Generated tokens, by API key id and model.", tag_keys=TOKEN_LABELS
        )

    def observe(
        self, key_id: str, model: str, status: int, prompt_tokens: int | None, output_tokens: int | None
    ) -> None:
        tags = {"key_id": key_id, "model": model}
        self.requests.inc(1, tags={**tags, "status": str(status)})
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, tags=tags)
        if output_tokens:
            self.generation_tokens.inc(output_tokens, tags=tags)


class AccessLog:
    """The access log: one JSON object a line, each line one ``write(2)`` of its own on a copy of stderr.

    Not through Python's ``logging``: a line through a Logger (a record, the
    caller's frame looked up, the handler's lock, a formatter, a flush) cost
    about 27 us a request in the vllm-server process's middleware
    (``python -m benchmarks.guard_overhead``), against about 4 us for the
    same line written here, on the core the engine shares. The line is
    written at once, not buffered: a replica that dies keeps every line of
    the requests it answered, and a line of at most ``PIPE_BUF`` bytes
    written in one call does not interleave with other writers' on a pipe.

    Its own descriptor, a copy of 2: vLLM's API server patches
    ``sys.stdout.write`` and ``sys.stderr.write`` to put
    "(APIServer pid=N) " before every line (``decorate_logs``); a line that
    starts so is no longer JSON to a log pipeline.
    """

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.dup(2) if fd is None else fd

    def write(self, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        while data:
            # A blocking descriptor writes the whole line unless a signal cuts it short.
            data = data[os.write(self.fd, data) :]

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class AccessRecord:
    """What one request leaves in the access log. Never a prompt, an answer or a key."""

    request_id: str
    key_id: str | None
    method: str
    path: str
    model: str | None = None
    status: int = 0
    stream: bool = False
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    tokens: TokenSource = "none"
    latency_ms: float = 0.0
    first_byte_ms: float | None = None
    refused: Refused | None = None
    event: str = field(default="request")

    def line(self) -> str:
        """The record as one JSON line.

        Its fields are flat JSON values, so the instance's own dict is the
        object: ``dataclasses.asdict`` deep-copies every field, which cost
        more than the rest of the line (about 20 us a request, on the hot path).
        """
        return json.dumps(vars(self), separators=(",", ":"))


class AnswerReader:
    """Reads the model, the usage and the stream's choice events out of an answer as it passes.

    A non-streamed answer is searched chunk by chunk for its usage (the last
    few bytes of a chunk are searched again with the next one, so a mark
    cut in two is still found). A stream is read lazily: its chunks are only
    kept (a reference, no copy) until :data:`STREAM_HOLD_BYTES` of them wait
    or a count is asked for, then joined, split into their events at the
    blank lines that end them and tested event by event in one tight loop;
    the bytes after the last whole event wait for the next batch, however
    the answer was cut into chunks. This runs in the server process, whose
    core the engine shares, once per streamed token. Measured in a serving
    replica under load, testing each event as it came cost up to 5.6 us of
    the API server's CPU a token, and reading them 32 at a time still about
    1.3 us; keeping a chunk costs an append. vLLM's own app (vllm-server)
    leaves the exact usage in the request state, so for an answer it
    finished nobody asks, and its held chunks are dropped unread
    (:meth:`KeyAccounting._tokens`).
    """

    def __init__(self) -> None:
        self.model: str | None = None
        self._usage: dict[str, Any] | None = None
        self._choice_events = 0
        self._head = b""
        # Whether the head of the answer is still read for the model's name.
        self._reading_head = True
        # A stream's chunks not read yet, and the bytes of the event the last batch ended inside.
        self._pending: list[bytes] = []
        self._held = 0
        self._tail = b""
        # A non-streamed answer: the last bytes searched, and the usage object begun.
        self._carry = b""
        self._usage_buf: bytearray | None = None

    @property
    def choice_events(self) -> int:
        """The stream's events that carried a choice with text, so far."""
        self._read_events()
        return self._choice_events

    @property
    def usage(self) -> dict[str, Any] | None:
        """The answer's usage object, the last one a stream carried."""
        self._read_events()
        return self._usage

    def feed(self, chunk: bytes, stream: bool) -> None:
        if not chunk:
            return
        if self._reading_head:
            self._head += chunk[: MODEL_SCAN_BYTES - len(self._head)]
            self.model = _decode_string_after(self._head, _MODEL_MARK)
            self._reading_head = self.model is None and len(self._head) < MODEL_SCAN_BYTES
        if stream:
            self._pending.append(chunk)
            self._held += len(chunk)
            if self._held >= STREAM_HOLD_BYTES:
                self._read_events()
            return
        self._scan_usage(chunk)

    def _read_events(self) -> None:
        if not self._pending:
            return
        data = self._tail + b"".join(self._pending)
        self._pending.clear()
        self._held = 0
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._tail = _kept_tail(data)
            return
        self._tail = _kept_tail(data[end + len(_EVENT_END) :])
        whole = data[:end]
        counted = 0
        for event in whole.split(_EVENT_END):
            # A choice with text; the usage-only event has `"choices":[]`.
            if (
                _CHOICE_MARK in event
                and _STREAM_EVENT in event
                and not (_EMPTY_STRING in event and _EMPTY_DELTA.search(event))
            ):
                counted += 1
        self._choice_events += counted
        if _USAGE_KEY in whole:
            # The last one: a stream's usage chunk ends it.
            begin = _last_usage_object(whole)
            if begin >= 0:
                # Inside its event, which is whole: the object ends before the event does.
                usage = _decode_object(whole[begin : begin + MAX_USAGE_BYTES])
                if usage is not None:
                    self._usage = usage

    def _scan_usage(self, chunk: bytes) -> None:
        if self._usage_buf is not None:
            self._usage_buf += chunk[:MAX_USAGE_BYTES]
            self._try_usage()
            return
        data = self._carry + chunk
        self._carry = data[-_CARRY_BYTES:]
        # The last one: an answer's usage follows its choices.
        start = _last_usage_object(data)
        if start < 0:
            return
        self._usage_buf = bytearray(data[start : start + MAX_USAGE_BYTES])
        self._carry = b""
        self._try_usage()

    def _try_usage(self) -> None:
        assert self._usage_buf is not None
        # From its "{": a whole object decodes to a dict, anything else is not there yet.
        value = _decode_object(self._usage_buf)
        if value is None:
            if len(self._usage_buf) >= MAX_USAGE_BYTES:
                self._usage_buf = None  # not a usage object after all
            return
        self._usage_buf = None
        self._usage = value


def _kept_tail(data: bytes) -> bytes:
    """The bytes of an unfinished event kept for the next batch: all of them, up to a bound.

    An event longer than :data:`MAX_EVENT_BYTES` (no stream of the served
    routes writes one) keeps its start, where the marks of a choice are.
    """
    return data if len(data) <= MAX_EVENT_BYTES else data[:MAX_EVENT_BYTES]


def _last_usage_object(data: bytes) -> int:
    """Where the last usage object in ``data`` begins (its "{"), or -1."""
    begin = -1
    for found in _USAGE.finditer(data):
        begin = found.end() - 1
    return begin


def _decode_object(data: bytes | bytearray) -> dict[str, Any] | None:
    """The JSON object ``data`` begins with, or None when it does not begin with a whole one."""
    try:
        value, _ = _JSON.raw_decode(data.decode("utf-8", "replace"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _decode_string_after(data: bytes, mark: bytes) -> str | None:
    at = data.find(mark)
    if at < 0:
        return None
    rest = data[at + len(mark) :].lstrip()
    try:
        value, _ = _JSON.raw_decode(rest.decode("utf-8", "replace"))
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _vllm_usage(scope: Scope) -> tuple[int | None, int | None] | None:
    """The usage vLLM's own app left in the request state (RequestResponseMetadata.final_usage_info)."""
    state = scope.get("state")
    metadata = state.get("request_metadata") if isinstance(state, dict) else None
    usage = getattr(metadata, "final_usage_info", None)
    if usage is None:
        return None
    return _int(getattr(usage, "prompt_tokens", None)), _int(getattr(usage, "completion_tokens", None))


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one, which the app then sees too."""
    for name, value in scope.get("headers") or ():
        if name == REQUEST_ID_HEADER:
            given = bytes(value).decode("latin-1").strip()
            if _REQUEST_ID.match(given):
                return given
    new = uuid.uuid4().hex
    # vLLM takes X-Request-Id as its own request id: its logs and traces then match this line.
    headers = [(k, v) for k, v in scope.get("headers") or () if k != REQUEST_ID_HEADER]
    scope["headers"] = [*headers, (REQUEST_ID_HEADER, new.encode())]
    return new


class KeyAccounting:
    """ASGI middleware: per-key in-flight caps, the access log and the per-key counters (module docstring).

    ``keys`` is the guard's own :class:`~inference_server.guard.ApiKeys`, so
    both read one keys file. ``model_ids`` are the served models; a name in
    an answer outside them is logged and counted as unknown (""), which
    keeps the metric labels bounded. ``default_model`` labels what the
    answer does not name (a vllm-server replica serves one model).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys,
        fairness: KeyFairness,
        replica_cap: int,
        model_ids: Collection[str] = (),
        default_model: str | None = None,
        metrics: KeyMetrics | None = None,
        log: AccessLog | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.app = app
        self.keys = keys
        self.fairness = fairness
        self.limiter = InflightLimiter(fairness, replica_cap)
        self.model_ids = frozenset(model_ids)
        self.default_model = default_model
        self.metrics = metrics
        self.log = log or AccessLog()
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith("/-/"):
            # Health probes and Serve's own routes: no key, nothing to attribute.
            await self.app(scope, receive, send)
            return
        started = self.clock()
        method = str(scope.get("method", "GET")).upper()
        record = AccessRecord(
            request_id=_request_id(scope), key_id=self.keys.identify(bearer_token(scope)), method=method, path=path
        )
        limited = record.key_id is not None and method == "POST" and path in LIMITED_PATHS
        if limited:
            assert record.key_id is not None
            record.refused = self.limiter.acquire(record.key_id)
            if record.refused is not None:
                await self._refuse(send, record)
                self._finish(record, started, None, scope)
                return
        reader = AnswerReader()
        try:
            await self.app(scope, receive, self._observing(send, record, reader, started))
        except Exception:
            # The server answers 500 for what escapes the app (a cancelled task, the client gone, stays 499).
            if record.status == 0:
                record.status = 500
            raise
        finally:
            if limited:
                assert record.key_id is not None
                self.limiter.release(record.key_id)
            self._finish(record, started, reader, scope)

    async def _refuse(self, send: Send, record: AccessRecord) -> None:
        assert record.key_id is not None and record.refused is not None
        cap = self.fairness.cap_for(record.key_id) if record.refused == "key" else self.limiter.replica_cap
        retry = self.fairness.retry_after_s
        record.status = 429
        await send_json(
            send,
            429,
            too_many_requests(record.refused, record.key_id, cap, retry),
            [(b"retry-after", str(retry).encode()), (REQUEST_ID_HEADER, record.request_id.encode())],
        )

    def _observing(self, send: Send, record: AccessRecord, reader: AnswerReader, started: float) -> Send:
        feed = reader.feed

        def observing(message: Message) -> Awaitable[None]:
            # A plain function that hands back `send`'s awaitable: it runs once
            # a streamed token, and a coroutine of its own would cost a frame
            # and an await on each.
            kind = message["type"]
            if kind == "http.response.body":
                # First: a streamed answer sends one of these a token.
                body = message.get("body")
                if body:
                    if record.first_byte_ms is None:
                        record.first_byte_ms = round((self.clock() - started) * 1000, 1)
                    feed(body if type(body) is bytes else bytes(body), record.stream)
            elif kind == "http.response.start":
                record.status = int(message.get("status", 0))
                headers = list(message.get("headers") or ())
                for name, value in headers:
                    if bytes(name).lower() == b"content-type":
                        record.stream = bytes(value).lower().startswith(b"text/event-stream")
                if not any(bytes(name).lower() == REQUEST_ID_HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, record.request_id.encode())]}
            return send(message)

        return observing

    def _model(self, reader: AnswerReader | None) -> str | None:
        named = reader.model if reader is not None else None
        if named is not None:
            return named if named in self.model_ids else ""
        return self.default_model

    def _tokens(self, record: AccessRecord, reader: AnswerReader | None, scope: Scope) -> None:
        if reader is None or record.status >= 400:
            return
        vllm = _vllm_usage(scope)
        if vllm is not None:
            record.prompt_tokens, record.output_tokens = vllm
            record.tokens = "exact"
        elif reader.usage is not None:
            record.prompt_tokens = _int(reader.usage.get("prompt_tokens"))
            record.output_tokens = _int(reader.usage.get("completion_tokens"))
            record.tokens = "exact"
        elif record.stream and record.path in LIMITED_PATHS:
            record.output_tokens = reader.choice_events
            record.tokens = "counted"

    def _finish(self, record: AccessRecord, started: float, reader: AnswerReader | None, scope: Scope) -> None:
        record.latency_ms = round((self.clock() - started) * 1000, 1)
        record.model = self._model(reader)
        self._tokens(record, reader, scope)
        if record.status == 0:
            # The app ended without answering: the client went away first (what nginx logs as 499).
            record.status = 499
        try:
            self.log.write(record.line())
            # A render is the request router preparing a client's request, not a request of the
            # key's own: logged, but not counted again in the key's requests.
            if self.metrics is not None and record.path not in RENDER_PATHS:
                prompt = record.prompt_tokens if record.tokens == "exact" else None
                self.metrics.observe(
                    record.key_id or "", record.model or "", record.status, prompt, record.output_tokens
                )
        except Exception:
            # Attribution must never fail a request that was answered.
            logging.getLogger(__name__).warning("access accounting failed", exc_info=True)
