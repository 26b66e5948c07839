"""The model gateway: one address for several models, each served by its own request router.

Each model has its own vllm-router (behind its nginx front). The gateway reads
the OpenAI request's ``model`` field and passes the request, unchanged, to that
model's router, streaming the answer back as it arrives.

vllm-router 0.1.17's own multi-model mode can not do this job: its discovery
asks each worker's ``/v1/models`` without a key (the guard answers 401), its
own ``/v1/models`` answers a shape that is not OpenAI's, and a request for a
model with no replica falls back to every worker instead of being refused.

The gateway checks the API key itself (the same keys and the same 401 as the
guard), so nothing about a model is revealed without one, and it forwards only
the API's routes: no router control route is ever reachable through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from pydantic import ValidationError
from yarl import URL

# The settings live apart, so the Pulumi program can build and check them without aiohttp.
from .gateway_settings import SETTINGS_ENV, GatewaySettings, Wake
from .guard import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    INVALID_REQUEST,
    SERVER_ERROR,
    UNAUTHORIZED_CHALLENGE,
    ApiKeys,
    Refusal,
    bearer_token,
    check_model,
    error_body,
    parse_json_object,
    too_large,
    unauthorized_body,
)

__all__ = ["SETTINGS_ENV", "Gateway", "GatewaySettings", "SettingsError", "load_settings", "main", "serve"]

logger = logging.getLogger("inference_server.gateway")

HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
# Every path the gateway answers, with its one method; anything else is 404 and never forwarded.
METHODS = {COMPLETIONS_PATH: "POST", CHAT_PATH: "POST", MODELS_PATH: "GET", HEALTH_PATH: "GET"}
# Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, not the request; Host and
# Content-Length are set again for the upstream connection.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
)
# Headers the client library would otherwise add: the upstream must see the caller's request only.
NO_AUTO_HEADERS = ("Accept-Encoding", "User-Agent", "Content-Type")
# How vllm-router (the release the image pins) begins its 503 when it has no worker to send
# to: the one 503 that means "no replica", as opposed to a replica's own 503 it passes on.
NO_WORKERS = b"No available workers"
# The shortest Retry-After the gateway gives for a model that is starting.
MIN_RETRY_AFTER_S = 5


class SettingsError(Exception):
    """The settings are missing or invalid; the message names the setting."""


def load_settings(environ: Mapping[str, str]) -> GatewaySettings:
    """The settings in ``environ``, or a :class:`SettingsError` naming what is wrong."""
    raw = environ.get(SETTINGS_ENV)
    if not raw:
        raise SettingsError(f"${SETTINGS_ENV} is not set")
    try:
        return GatewaySettings.model_validate(json.loads(raw))
    except json.JSONDecodeError as err:
        raise SettingsError(f"${SETTINGS_ENV} is not valid JSON: {err.msg}") from None
    except ValidationError as err:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or SETTINGS_ENV}: {e['msg']}" for e in err.errors(include_url=False)
        ]
        raise SettingsError(f"invalid setting {'; '.join(problems)}") from None


def _refuse(refusal: Refusal, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=refusal.status, body=refusal.body(), content_type="application/json", headers=headers or None
    )


def _presented_key(request: web.Request) -> str | None:
    """The bearer key, read by the guard's own parser so both accept exactly the same headers."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: this gives the raw bytes back.
    return bearer_token({"headers": [(b"authorization", header.encode("utf-8", "surrogateescape"))]})


def _unavailable(status: int, message: str) -> web.Response:
    body = error_body(message, type_=SERVER_ERROR, param=None, code="model_unavailable")
    return web.Response(status=status, body=body, content_type="application/json", headers={"Retry-After": "1"})


def _forwarded(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """``headers`` without the hop-by-hop ones, those the Connection header names included."""
    named = {t.strip().lower() for v in headers.getall("Connection", ()) for t in v.split(",")}
    return [
        (k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP | named and not k.lower().startswith("proxy-")
    ]


@dataclass
class Waking:
    """One model's wake, as one gateway process sees it: the requests it holds and its wake in flight."""

    held: int = 0
    task: asyncio.Task[None] | None = None
    # When the current wake began (the event loop's clock).
    started: float | None = None


class Gateway:
    """The gateway's routes, its shared upstream session and its counters."""

    def __init__(self, settings: GatewaySettings, keys: ApiKeys, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.keys = keys
        self.draining = False
        self.requests = Counter(
            "llm_gateway_requests",
            "Requests answered, by routed model and status.",
            ["model", "code"],
            registry=registry,
        )
        self.failures = Counter(
            "llm_gateway_upstream_failures", "Upstream requests that failed, by model.", ["model"], registry=registry
        )
        self.wakes = Counter(
            "llm_gateway_wakes", "Wakes started for a model at zero replicas.", ["model"], registry=registry
        )
        self.held = Gauge(
            "llm_gateway_held_requests", "Requests held while their model wakes.", ["model"], registry=registry
        )
        self.waking: dict[str, Waking] = {}
        self.timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        # limit=0: the routers behind hold the concurrency limits, not the gateway's pool.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=self.timeout)

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def on_prepare(self, _request: web.Request, response: web.StreamResponse) -> None:
        # While draining, close each connection after its answer, so clients reconnect elsewhere.
        if self.draining:
            response.force_close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every request: the route, then the key, then the body; /health needs no key."""
        model = ""
        response: web.StreamResponse | None = None
        try:
            response, model = await self._dispatch(request)
            return response
        finally:
            if request.path != HEALTH_PATH:
                status = response.status if response is not None else 499
                self.requests.labels(model=model, code=str(status)).inc()

    async def _dispatch(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        path, method = request.path, request.method
        allowed = METHODS.get(path)
        if allowed is None:
            message = f"Invalid URL ({method} {path})"  # the guard's answer for a route it does not serve
            body = error_body(message, type_=INVALID_REQUEST, param=None, code=None)
            return web.Response(status=404, body=body, content_type="application/json"), ""
        if method != allowed:
            refusal = Refusal(405, f"Method {method} is not allowed for {path}.", None, "method_not_allowed")
            return _refuse(refusal, {"Allow": allowed}), ""
        if path == HEALTH_PATH:
            if self.draining:
                body = error_body("the gateway is draining", type_="unavailable", param=None, code="draining")
                return web.Response(status=503, body=body, content_type="application/json"), ""
            return web.json_response({"status": "ok"}), ""
        if not self.keys.verify(_presented_key(request)):
            return self._unauthorized(), ""
        if path == MODELS_PATH:
            return await self._models(request), ""
        return await self._generate(request)

    @staticmethod
    def _unauthorized() -> web.Response:
        # The guard's own 401, so clients see one behaviour wherever they are refused.
        return web.Response(
            status=401,
            body=unauthorized_body(),
            content_type="application/json",
            headers={"WWW-Authenticate": UNAUTHORIZED_CHALLENGE.decode()},
        )

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The body, or None once it passes the cap (never more than one chunk past it is read);
        TimeoutError when it takes longer than ``body_timeout_s``."""
        cap = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            return None
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.settings.body_timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > cap:
                    return None
                chunks.append(chunk)
        return b"".join(chunks)

    async def _generate(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        try:
            raw = await self._read_body(request)
        except TimeoutError:
            message = f"The request body was not received within {self.settings.body_timeout_s:.0f}s."
            # The rest of the body may still be on its way: the connection is not reused.
            return _refuse(Refusal(408, message, None, "request_timeout"), {"Connection": "close"}), ""
        if raw is None:
            return _refuse(too_large(self.settings.max_body_bytes)), ""
        body = parse_json_object(raw)
        if isinstance(body, Refusal):
            return _refuse(body), ""
        model = body.get("model")
        if model is None:
            # The guard leaves a missing model to the engine; here it decides where the request goes.
            return _refuse(Refusal(400, "you must provide a model parameter", param="model", code="missing_model")), ""
        # A model that is not a string: 400; one no route serves: 404, both as the guard answers them.
        refusal = check_model(body, self.settings.routes)
        if refusal is not None:
            return _refuse(refusal), ""
        return await self._forward(request, model, raw), model

    async def _forward(self, request: web.Request, model: str, raw: bytes) -> web.StreamResponse:
        upstream = await self._send(request, model, raw)
        if isinstance(upstream, web.Response):
            return upstream
        wake = self.settings.wake.get(model)
        if wake is None:
            return await self._relay(request, model, upstream)
        answer = await self._unless_no_worker(request, model, upstream)
        return answer if answer is not None else await self._hold(request, model, raw, wake)

    async def _unless_no_worker(
        self, request: web.Request, model: str, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse | None:
        """The router's answer relayed, or None when it has no replica of the model to send to."""
        if upstream.status != 503:
            return await self._relay(request, model, upstream)
        # A 503 is short (the router's text, or a replica's JSON): read it whole to see whose it is.
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError):
            body = b""
        finally:
            upstream.close()
        if body.startswith(NO_WORKERS):
            return None
        return web.Response(status=503, body=body, headers=_forwarded(upstream.headers))

    async def _send(self, request: web.Request, model: str, raw: bytes) -> aiohttp.ClientResponse | web.Response:
        """The request sent to the model's router: its answer, or the gateway's own when there is none."""
        assert self.session is not None
        url = URL(self.settings.routes[model] + request.raw_path, encoded=True)
        headers = _forwarded(request.headers)
        try:
            return await self.session.post(url, data=raw, headers=headers, skip_auto_headers=NO_AUTO_HEADERS)
        except aiohttp.ConnectionTimeoutError:
            self.failures.labels(model=model).inc()
            return _unavailable(503, f"The model `{model}` is not reachable. Please retry your request.")
        except TimeoutError:
            self.failures.labels(model=model).inc()
            return _unavailable(504, f"The model `{model}` did not answer in time. Please retry your request.")
        except aiohttp.ClientError as err:
            self.failures.labels(model=model).inc()
            logger.warning("upstream of %s failed before answering: %s", model, type(err).__name__)
            return _unavailable(503, f"The model `{model}` is not reachable. Please retry your request.")

    async def _relay(self, request: web.Request, model: str, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """The router's answer, streamed to the client chunk by chunk."""
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in _forwarded(upstream.headers):
                response.headers.add(name, value)
            if upstream.content_length is not None and "chunked" not in upstream.headers.get("Transfer-Encoding", ""):
                response.content_length = upstream.content_length
            await response.prepare(request)
            # Each chunk as it arrives: a token must reach the client when the model made it.
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        except ConnectionResetError:
            return response  # the client went away: nothing to answer, the upstream request is closed below
        except (aiohttp.ClientError, TimeoutError) as err:
            # The answer has started: its status can not change, so the connection is cut
            # and the client sees a truncated answer rather than a complete-looking one.
            self.failures.labels(model=model).inc()
            logger.warning("upstream of %s failed while answering: %s", model, type(err).__name__)
            if request.transport is not None:
                request.transport.abort()
            return response
        finally:
            # Closed, not released: a half-read answer (the client went away) must not be reused.
            upstream.close()

    # ------------------------------------------------------------------ waking a model at zero

    async def _hold(self, request: web.Request, model: str, raw: bytes, wake: Wake) -> web.StreamResponse:
        """Hold the request while its model wakes, trying its router again until a replica answers it.

        Bounded twice: at most ``max_held`` requests wait per model (more are
        refused at once), and each waits at most ``hold_s``. Either way the
        client gets a 503 whose Retry-After is what is left of the model's
        cold start, so it comes back when a replica should be up.
        """
        state = self.waking.setdefault(model, Waking())
        if state.held >= wake.max_held:
            return self._still_waking(model, wake, state, "too many requests are waiting for it")
        state.held += 1
        self.held.labels(model=model).inc()
        try:
            self._wake(model, wake, state)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wake.hold_s
            while (left := deadline - loop.time()) > 0:
                await asyncio.sleep(min(self.settings.wake_poll_s, left))
                upstream = await self._send(request, model, raw)
                if isinstance(upstream, web.Response):
                    continue  # the router itself is not reachable (restarting): keep holding
                answer = await self._unless_no_worker(request, model, upstream)
                if answer is not None:
                    return answer
            return self._still_waking(model, wake, state, f"no replica answered within {wake.hold_s:.0f}s")
        finally:
            state.held -= 1
            self.held.labels(model=model).dec()

    def _wake(self, model: str, wake: Wake, state: Waking) -> None:
        """Start waking ``model`` unless a wake is already under way (one per model and gateway)."""
        if state.task is not None and not state.task.done():
            return
        state.started = asyncio.get_running_loop().time()
        state.task = asyncio.create_task(self._waking(model, wake, state))
        self.wakes.labels(model=model).inc()
        logger.info("waking %s", model)

    async def _waking(self, model: str, wake: Wake, state: Waking) -> None:
        """One request at a time to the model's Serve proxy, until one is answered or nobody waits.

        Serve holds the request until a replica is up (its answer is the
        replica's ``__call__``), so one long request keeps the cold start
        going; one that fails (the head restarting) is sent again.
        """
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=wake.cold_start_s * 2, sock_connect=self.settings.connect_timeout_s)
        while True:
            try:
                async with self.session.post(wake.url, data=b"", timeout=timeout) as answer:
                    await answer.read()
                    if answer.status == 200:
                        logger.info("%s is awake", model)
                        return
                    logger.warning("waking %s: the Serve proxy answered %d", model, answer.status)
            except (aiohttp.ClientError, TimeoutError) as err:
                logger.warning("waking %s failed: %s", model, type(err).__name__)
            if state.held == 0:
                return  # nobody waits; the next request starts a new wake
            await asyncio.sleep(self.settings.wake_poll_s)

    def _still_waking(self, model: str, wake: Wake, state: Waking, why: str) -> web.Response:
        elapsed = asyncio.get_running_loop().time() - (state.started or 0.0)
        retry_after = max(MIN_RETRY_AFTER_S, math.ceil(wake.cold_start_s - elapsed))
        message = f"The model `{model}` is starting from zero replicas and {why}. Retry after {retry_after}s."
        body = error_body(message, type_=SERVER_ERROR, param=None, code="model_starting")
        return web.Response(
            status=503, body=body, content_type="application/json", headers={"Retry-After": str(retry_after)}
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """Every route's model list, merged in route order; routes that fail are left out."""
        auth = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}

        async def ask(model: str, base: str) -> list[Any] | None:
            assert self.session is not None
            try:
                url = base + MODELS_PATH
                async with self.session.get(url, headers=auth, skip_auto_headers=NO_AUTO_HEADERS) as upstream:
                    if upstream.status != 200:
                        return None
                    data = (await upstream.json(content_type=None)).get("data")
                    return data if isinstance(data, list) else None
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                self.failures.labels(model=model).inc()
                return None

        answers = await asyncio.gather(*(ask(m, base) for m, base in self.settings.routes.items()))
        if all(a is None for a in answers):
            return _unavailable(503, "No model answered. Please retry your request.")
        merged: dict[str, Any] = {}
        for answer in answers:
            for card in answer or ():
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    merged.setdefault(card["id"], card)
        return web.json_response({"object": "list", "data": list(merged.values())})


async def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring) and return."""
    registry = CollectorRegistry()
    gateway = Gateway(settings, ApiKeys(settings.api_keys_file, settings.api_keys_env), registry)
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", gateway.handle)
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    app.on_response_prepare.append(gateway.on_prepare)
    # handler_cancellation: a client that goes away cancels its handler, which closes the upstream request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=settings.request_timeout_s)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
        logger.info("gateway listening on http://%s:%d", settings.host, settings.port)
        await stop.wait()
        # /health fails at once; new requests are still served while the load balancer notices.
        gateway.draining = True
        logger.info("gateway draining for %.1fs", settings.drain_s)
        await asyncio.sleep(settings.drain_s)
    finally:
        # Stops accepting, then waits up to request_timeout_s for the requests in flight.
        await runner.cleanup()
    logger.info("gateway stopped")


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the settings from the environment and serve until told to stop."""
    del argv  # every setting comes from the environment
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(os.environ)
    except SettingsError as err:
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings))
    except OSError as err:
        print(f"gateway: can not listen on {settings.host}:{settings.port}: {err.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
