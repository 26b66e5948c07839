"""Calling the API-key guard in-process: a recording downstream app, one request through the guard, its answer.

Shared by the guard's unit tests (serve-ingress's ApiGuard and vLLM's server guard).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from inference_server.catalog import RequestLimits
from inference_server.guard import ApiGuard, ApiKeys

UNSET: Any = object()
MODELS = ("m", "org/name")


class Recorder:
    """A downstream ASGI app that records what reached it and answers with a canned response."""

    def __init__(self, status: int = 200, body: bytes = b"ok", chunks: int = 1) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.status, self.body, self.chunks = status, body, chunks
        self.disconnected = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    break
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope.get("path", ""), body))
        headers = [(b"content-type", b"application/json"), (b"x-request-id", b"rid-1")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        step = max(1, -(-len(self.body) // self.chunks))
        parts = [self.body[i : i + step] for i in range(0, len(self.body), step)] or [b""]
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    raw: bytes
    receives: int

    @property
    def error(self) -> dict[str, Any]:
        doc = json.loads(self.raw)
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert int(self.headers[b"content-length"]) == len(self.raw)
        return dict(doc["error"])


def call(
    guard: ApiGuard,
    path: str,
    *,
    key: str | None = "k1",
    body: Any = UNSET,
    raw: bytes | None = None,
    method: str = "POST",
    chunks: list[bytes] | None = None,
    content_type: str | None = "application/json",
    content_length: bool = True,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    forbid_reading: bool = False,
) -> Answer:
    if raw is None:
        raw = json.dumps(body).encode() if body is not UNSET else b""
    parts = chunks if chunks is not None else [raw]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    head: list[tuple[bytes, bytes]] = list(headers)
    if content_type is not None:
        head.append((b"content-type", content_type.encode()))
    if content_length and chunks is None:
        head.append((b"content-length", str(len(raw)).encode()))
    if key is not None:
        head.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": head, "root_path": ""}
    sent: list[dict[str, Any]] = []
    receives = 0

    async def receive() -> dict[str, Any]:
        nonlocal receives
        assert not forbid_reading, "the body was read"
        receives += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    start = sent[0]
    assert start["type"] == "http.response.start"
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return Answer(start["status"], dict(start.get("headers") or []), payload, receives)


def make_guard(counter: Any = None, downstream: Recorder | None = None, **limits: Any) -> tuple[ApiGuard, Recorder]:
    downstream = downstream or Recorder()
    keys = ApiKeys(None, "K", environ={"K": "k1,k2"})
    guard = ApiGuard(
        downstream, keys=keys, limits=RequestLimits(**limits), model_ids=MODELS, count_prompt_tokens=counter
    )
    return guard, downstream


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Downstream:
    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


class FakeTokenization:
    """vLLM's tokenization handler as the guard calls it: a token a word, and the chat template's three."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def create_tokenize(self, request: Any, raw_request: Any) -> Any:
        self.requests.append(request)
        if hasattr(request, "prompt"):
            return SimpleNamespace(count=len(str(request.prompt).split()))
        words = sum(len(str(m.get("content")).split()) for m in request.messages)
        return SimpleNamespace(count=words + 3)


def send_to(
    app: Any,
    path: str,
    *,
    method: str = "POST",
    key: str | None = "k1",
    body: Any = None,
    tokenization: Any = UNSET,
) -> tuple[int, Any]:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "headers": headers, "root_path": ""}
    # What FastAPI puts in the scope: the app, whose state holds vLLM's handlers once started.
    handler = FakeTokenization() if tokenization is UNSET else tokenization
    scope["app"] = SimpleNamespace(state=SimpleNamespace(serving_tokenization=handler))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(payload) if payload else None
