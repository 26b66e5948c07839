"""The API-key guard and request limits inside vLLM's own OpenAI server ("vllm-server" layout).

vLLM's ``--middleware`` takes an import path and adds the class with no
arguments, so the settings come from the environment the replica gives its
server process (:data:`SETTINGS_ENV`: key locations and limits, never keys).
Prompts the cheap byte bounds can not decide are counted by vLLM's own
tokenization handler, with the model's chat template, in this process.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .catalog import NODE_DRAIN_FILE_ENV, KeyFairness, RequestLimits, ServeAutoscaling
from .fairness import KeyAccounting, PrometheusKeyMetrics
from .guard import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    INVALID_REQUEST,
    MODEL_PATH_PREFIX,
    OPEN_PATHS,
    RENDER_PATHS,
    ApiGuard,
    ApiKeys,
    error_body,
    send_json,
    tokenize_requests,
)

SETTINGS_ENV = "INFERENCE_GUARD_SETTINGS"
# While this file exists the replica is draining: /health answers 503, so the
# readiness probe takes the pod out of the Service and the load balancer
# stops sending it new requests while it finishes the ones it holds.
DRAIN_FILE_ENV = "INFERENCE_DRAIN_FILE"
# NODE_DRAIN_FILE_ENV (catalog): the same for every server of the pod, which
# its preStop hook creates when the pod is deleted (a NewCluster upgrade
# removing the old cluster, a node drain), whether or not Ray can still reach its GCS.
HEALTH_PATH = "/health"
# How old the drain files' reading a request goes by may be. /health reads
# them afresh each time, so the readiness probe (and the request router's
# health check) sees a drain at once; other requests read them at most this
# often, so answers start closing their connections within this much of it,
# far inside the drain notice. Two stat(2) calls on each request cost about
# 6 us of the API server's CPU, on the core the engine shares
# (``python -m benchmarks.guard_overhead``).
DRAIN_REREAD_S = 0.5
# The routes this layout serves: the ones Serve LLM's OpenAI ingress serves
# and the guard's limits cover. vLLM's server has many more (the Responses and
# Anthropic APIs, token-level generate, elastic scaling, profiling), whose
# token counts the limits do not read or which no client should reach; they
# answer 404 here, as they do behind the serve-ingress layout. The render
# routes are served for the request router (guard.RENDER_PATHS: checked and
# limited as the generation request whose body they take).
SERVED_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH, "/v1/models", *RENDER_PATHS})


class ServerGuardSettings(BaseModel):
    """What the guard in the server process needs. Holds key locations, never keys."""

    model_config = ConfigDict(extra="forbid")

    api_keys_file: str | None
    api_keys_env: str
    limits: RequestLimits
    model_ids: list[str]
    fairness: KeyFairness = Field(default_factory=KeyFairness)
    # The model's max_ongoing_requests: Serve never sees this server's
    # requests, so the guard is what holds a replica to it.
    replica_inflight_cap: int = Field(default=ServeAutoscaling().max_ongoing_requests, ge=1)


def _tokenize_requests(path: str, body: dict[str, Any]) -> list[Any]:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

    return tokenize_requests(path, body, body.get("model"), TokenizeChatRequest, TokenizeCompletionRequest)


def _closing(send: Any) -> Any:
    """`send` with ``connection: close`` on the response: the server closes the connection after it."""

    async def closing(message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing


@cache
def _key_metrics() -> PrometheusKeyMetrics:
    """The per-key counters, once per process, on the registry vLLM's metrics port serves (vllm_main)."""
    return PrometheusKeyMetrics()


def _served(path: str) -> bool:
    return path in SERVED_PATHS or path in OPEN_PATHS or path.startswith(MODEL_PATH_PREFIX)


class VllmServerGuard(ApiGuard):
    """:class:`ApiGuard` configured from :data:`SETTINGS_ENV`, counting prompts with vLLM's tokenizer."""

    # When the drain files were read (a test moves it on).
    clock = staticmethod(time.monotonic)

    def __init__(self, app: Any) -> None:
        raw = os.environ.get(SETTINGS_ENV)
        if not raw:
            # Without settings there are no keys: refuse to start rather than serve openly.
            raise RuntimeError(f"${SETTINGS_ENV} is not set: the server would run without its API keys")
        settings = ServerGuardSettings.model_validate(json.loads(raw))
        super().__init__(
            app,
            keys=ApiKeys(settings.api_keys_file, settings.api_keys_env),
            limits=settings.limits,
            model_ids=settings.model_ids,
            count_prompt_tokens=self._count_prompt_tokens,
        )
        # Outside the guard's checks, so its refusals are logged and counted too.
        self.accounting = KeyAccounting(
            self._guarded,
            keys=self.keys,
            fairness=settings.fairness,
            replica_cap=settings.replica_inflight_cap,
            model_ids=settings.model_ids,
            default_model=settings.model_ids[0] if len(settings.model_ids) == 1 else None,
            metrics=_key_metrics(),
        )
        self._state: Any = None
        self._drain_files = [f for f in (os.environ.get(DRAIN_FILE_ENV), os.environ.get(NODE_DRAIN_FILE_ENV)) if f]
        self._draining = False
        self._drain_read_at = float("-inf")

    def draining(self, *, afresh: bool = False) -> bool:
        """Whether the replica (its own file) or its whole pod (the preStop hook's file) is draining.

        Read from the files ``afresh``, or when the last reading is
        :data:`DRAIN_REREAD_S` old; a file, once there, stays until the server stops.
        """
        now = self.clock()
        if afresh or now - self._drain_read_at >= DRAIN_REREAD_S:
            self._drain_read_at = now
            self._draining = any(os.path.exists(f) for f in self._drain_files)
        return self._draining

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._state is None and scope.get("app") is not None:
            # The FastAPI app, whose state holds vLLM's handlers once it started.
            self._state = scope["app"].state
        if scope.get("type") != "http":
            await self.accounting(scope, receive, send)
            return
        path = self._path(scope)
        if self.draining(afresh=path == HEALTH_PATH):
            if path == HEALTH_PATH:
                body = error_body("the replica is draining", type_="unavailable", param=None, code="draining")
                await send_json(send, 503, body, [(b"connection", b"close")])
                return
            # Still served, but each answer closes its connection: a client's
            # keep-alive connection would otherwise stay on this server (a
            # load balancer moves only new connections) until it stops.
            send = _closing(send)
        if not _served(path):
            # What the OpenAI API itself answers for a route it does not have.
            method = str(scope.get("method", "GET")).upper()
            body = error_body(f"Invalid URL ({method} {path})", type_=INVALID_REQUEST, param=None, code=None)
            await send_json(send, 404, body)
            return
        await self.accounting(scope, receive, send)

    async def _guarded(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)

    async def _count_prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """One exact count per prompt; None when vLLM answered a tokenize request with an error."""
        handler = getattr(self._state, "serving_tokenization", None)
        if handler is None:
            # Not started yet: the guard answers 503 rather than pass an uncounted prompt.
            raise RuntimeError("vLLM's tokenization handler is not available")
        counts = []
        for request in _tokenize_requests(path, body):
            response = await handler.create_tokenize(request, None)
            count = getattr(response, "count", None)
            if count is None:
                return None
            counts.append(count)
        return counts
