"""One OpenAI base URL for every model of a stack on this machine: the twin's load balancer, routing by model.

Deployed, each RayService has its own endpoint (its load balancer in front
of its serve Service), and in the vllm-server layout that load balancer
sends each new connection to one replica's own vLLM server. No routing
tier stands in front of them yet. The local run serves the whole stack at
one base URL, so this front door reads each request's ``model`` first and
then does what the twin's NLB (:class:`twin.upgrade.LoadBalancer`) does:
a connection to one of that model's Ready targets, round robin, the bytes
passed through unchanged (streams included). Everything else stays with
the targets: the API-key guard, the request limits and the errors.

What it adds to the NLB, all of it HTTP/1.1 framing:

* each request gets its own upstream connection (``Connection: close``
  both ways), so a client's kept-alive connection never carries a request
  for one model to another model's server;
* ``GET /v1/models`` asks one target of each model with the caller's
  headers and answers the union, or the first refusal as it came (401
  without a key);
* a request naming no model, or one the stack does not serve, goes to any
  target, whose guard answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from twin.upgrade import HOST, LoadBalancer
from workloads.inference_server.guard import INVALID_REQUEST, SERVER_ERROR, error_body

Target = tuple[str, str, int]  # (name, host, port), as the NLB keeps them
Routes = dict[str, list[Target]]  # model id -> its Ready targets

MODELS_PATH = "/v1/models"
# Far above any guard's body cap (inference_server.guard.body_cap): the guard, not the door, sizes requests.
MAX_BODY_BYTES = 64 * 2**20
MAX_HEAD_BYTES = 64 * 1024
REFRESH_EVERY_S = 1.0
# Hop-by-hop headers the door sets itself (it forwards the body whole, with its length).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "expect", "content-length"}
)


class BadRequestError(Exception):
    """A request the door can not frame; answered with ``status`` before any target sees it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Request:
    """One client request, read whole."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def path(self) -> str:
        """The path without its query."""
        return self.target.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        """A header's value (the first of that name)."""
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def model(self) -> str | None:
        """The model the request names: the JSON body's ``model``, or ``/v1/models/<id>``."""
        if self.path.startswith(MODELS_PATH + "/"):
            return self.path[len(MODELS_PATH) + 1 :] or None
        try:
            body = json.loads(self.body) if self.body else None
        except ValueError:
            return None
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) else None

    def upstream(self, target: str | None = None, body: bytes | None = None) -> bytes:
        """The request as the door sends it on: its own connection, the body whole with its length."""
        payload = self.body if body is None else body
        kept = [(k, v) for k, v in self.headers if k.lower() not in _HOP_HEADERS]
        if payload or self.method not in ("GET", "HEAD"):
            kept.append(("Content-Length", str(len(payload))))
        kept.append(("Connection", "close"))
        head = f"{self.method} {target or self.target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
        return (head + "\r\n").encode("latin-1") + payload


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, decoded (trailers dropped)."""
    body = bytearray()
    while True:
        try:
            size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
        except ValueError:
            raise BadRequestError(400, "a chunk's size is not a hex number", "bad_request") from None
        if size == 0:
            while (await reader.readline()).strip():
                pass
            return bytes(body)
        if len(body) + size > MAX_BODY_BYTES:
            raise BadRequestError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large")
        body += await reader.readexactly(size)
        await reader.readline()


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    """The start line and the headers of a message head."""
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
    """The next request on the connection, body included; None when the client closed first."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise BadRequestError(431, "the request's headers are too large", "headers_too_large") from None
    start, headers = _parse_head(raw)
    parts = start.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequestError(400, "not an HTTP/1.1 request", "bad_request")
    request = Request(method=parts[0].upper(), target=parts[1], headers=headers, body=b"")
    if (request.header("expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in (request.header("transfer-encoding") or "").lower():
        return Request(request.method, request.target, headers, await _read_chunked(reader))
    try:
        length = int(request.header("content-length") or 0)
    except ValueError:
        raise BadRequestError(400, "Content-Length is not a number", "bad_request") from None
    if length > MAX_BODY_BYTES:
        raise BadRequestError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large")
    return Request(request.method, request.target, headers, await reader.readexactly(length) if length else b"")


def _closing_head(raw: bytes) -> bytes:
    """A response head with ``connection: close``, as the door ends every connection after one answer."""
    start, headers = _parse_head(raw)
    kept = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive")]
    kept.append(("connection", "close"))
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept) + "\r\n").encode("latin-1")


def response(status: int, body: bytes) -> bytes:
    """A whole JSON response that closes the connection."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("latin-1") + body


async def _fetch(target: Target, request: Request) -> tuple[int, bytes]:
    """One whole answer from ``target`` (status and body), for ``/v1/models``."""
    up_reader, up_writer = await asyncio.open_connection(target[1], target[2])
    try:
        up_writer.write(request.upstream())
        await up_writer.drain()
        start, headers = _parse_head(await up_reader.readuntil(b"\r\n\r\n"))
        chunked = "chunked" in next((v.lower() for k, v in headers if k.lower() == "transfer-encoding"), "")
        body = await _read_chunked(up_reader) if chunked else await up_reader.read()
        return int(start.split(" ")[1]), body
    finally:
        up_writer.close()


@dataclass
class FrontDoor(LoadBalancer):
    """The twin's load balancer with one target set per model, filled from the running stack."""

    routes: Routes = field(default_factory=dict)
    _cycles: dict[str, itertools.count[int]] = field(default_factory=dict)
    _following: threading.Event = field(default_factory=threading.Event)

    def set_routes(self, routes: Routes) -> None:
        """Each model's Ready targets (the NLB's targets become all of them)."""
        with self._lock:
            self.routes = {model: list(targets) for model, targets in routes.items()}
            self.targets = list(dict.fromkeys(t for targets in routes.values() for t in targets))

    def has_target(self, model: str) -> bool:
        """Whether a request for ``model`` has somewhere to go now."""
        with self._lock:
            return bool(self.routes.get(model))

    def pick(self, model: str | None) -> Target | None:
        """The next target for ``model``: its own, round robin; any target for no model or one not served."""
        with self._lock:
            own = self.routes.get(model) if model is not None else None
            targets = self.targets if own is None else own
            if not targets:
                self.refused += 1
                return None
            # A count per model: requests for other models in between must not skip a replica.
            cycle = self._cycles.setdefault(model if own is not None and model else "", itertools.count())
            target = targets[next(cycle) % len(targets)]
            self.connections[target[0]] = self.connections.get(target[0], 0) + 1
            return target

    def start(self) -> None:
        """Listens on ``port`` now (OSError when something else does), then serves from a thread.

        The port is read back from the socket: with port 0 it is the one the kernel gave.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Without SO_REUSEPORT, as twin.local_run.port_is_free binds: a Serve proxy on the port refuses us.
            sock.bind((HOST, self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        self._run_server(lambda: asyncio.start_server(self._handle, sock=sock, limit=MAX_HEAD_BYTES), "front-door")

    def follow(self, source: Callable[[], Routes], every_s: float = REFRESH_EVERY_S) -> None:
        """Takes the routes from ``source`` now and then every ``every_s`` in a thread, as the NLB's health checks."""
        self.set_routes(source())

        def loop() -> None:
            while not self._following.wait(every_s):
                with contextlib.suppress(Exception):
                    self.set_routes(source())

        threading.Thread(target=loop, daemon=True, name="front-door-routes").start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops following the routes and serving (closing the connections still open)."""
        self._following.set()
        super().stop(timeout_s)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        finally:
            # One request per connection, and a stopping door closes what it still holds.
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_request(reader, writer)
        except BadRequestError as err:
            await self._answer(
                writer, err.status, error_body(str(err), type_=INVALID_REQUEST, param=None, code=err.code)
            )
            return
        except (OSError, asyncio.IncompleteReadError):
            request = None  # the client went away mid-request
        if request is None:
            return
        if request.method == "GET" and request.path == MODELS_PATH:
            await self._models(request, writer)
            return
        model = request.model
        target = self.pick(model)
        if target is None:
            await self._unavailable(writer, model)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(target[1], target[2])
        except OSError:
            await self._bad_gateway(writer, target)
            return
        try:
            up_writer.write(request.upstream())
            await up_writer.drain()
            head = await up_reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            await self._bad_gateway(writer, target)
        else:
            writer.write(_closing_head(head))
            await self._pipe(up_reader, writer)
        finally:
            with contextlib.suppress(OSError):
                up_writer.close()

    async def _models(self, request: Request, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            models = sorted(self.routes)
        targets = [t for t in (self.pick(m) for m in models) if t is not None]
        if not targets:
            await self._unavailable(writer, None)
            return
        try:
            answers = await asyncio.gather(*(_fetch(t, request) for t in targets))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            message = "a replica did not answer /v1/models"
            await self._answer(writer, 502, error_body(message, type_=SERVER_ERROR, param=None, code="bad_gateway"))
            return
        refused = next(((status, body) for status, body in answers if status != 200), None)
        if refused is not None:
            await self._answer(writer, *refused)
            return
        seen: dict[str, object] = {}
        for _, body in answers:
            for entry in json.loads(body).get("data") or []:
                seen.setdefault(str(entry.get("id")), entry)
        await self._answer(writer, 200, json.dumps({"object": "list", "data": list(seen.values())}).encode())

    async def _bad_gateway(self, writer: asyncio.StreamWriter, target: Target) -> None:
        message = f"the replica at {target[1]}:{target[2]} did not answer"
        await self._answer(writer, 502, error_body(message, type_=SERVER_ERROR, param=None, code="bad_gateway"))

    async def _unavailable(self, writer: asyncio.StreamWriter, model: str | None) -> None:
        what = f"no replica of {model} is Ready" if model in self.routes else "no replica of the stack is Ready"
        await self._answer(writer, 503, error_body(what, type_=SERVER_ERROR, param=None, code="unavailable"))

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):
            writer.write(response(status, body))
            await writer.drain()
            writer.close()
