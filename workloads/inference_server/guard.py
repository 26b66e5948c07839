"""API-key authentication and request limits, as one pure ASGI middleware.

This module needs only the standard library and the catalogue (pydantic), so it
is cheap to import and to test. The server installs :class:`ApiGuard` as the
outermost middleware of the OpenAI-compatible FastAPI app that Ray Serve LLM
builds, which keeps the checks in the same process as the routes: no extra
network hop, one JSON parse per generation request and nothing at all for the
health routes.

Keys are never logged and never echoed back in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .catalog import RequestLimits

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Counts the prompt tokens of one generation request exactly (the engine's own
# tokenizer and chat template). Given the route path and the parsed JSON body;
# returns None when it can not tell, and the engine then decides on its own.
PromptTokenCounter = Callable[[str, dict[str, Any]], Awaitable[int | None]]

# Routes that stay open: Serve's own health and route table, and the engine's
# health probe. Everything else needs a key.
OPEN_PATHS = frozenset({"/-/healthz", "/-/routes", "/health", "/ping", "/version"})
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
LIMITED_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})

# The cheap prompt bound: a token of a byte-level BPE or SentencePiece
# vocabulary covers at least one UTF-8 byte, so a prompt's byte count plus what
# a chat template adds around each message bounds its token count from above.
CHAT_TEMPLATE_TOKENS = 64
CHAT_TOKENS_PER_MESSAGE = 16
# A body larger than this is refused before it is buffered.
MAX_BODY_BYTES = 64 * 1024 * 1024


def error_body(message: str, *, type_: str, param: str | None, code: str | None) -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_json(send: Send, status: int, body: bytes, extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys_file(text: str) -> list[str]:
    """Keys from a mounted file: one a line; blank lines and ``#`` comments ignored."""
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def parse_keys_env(text: str) -> list[str]:
    """Keys from an environment variable: comma-separated."""
    return [part.strip() for part in text.split(",") if part.strip()]


class ApiKeys:
    """The accepted API keys, read from a mounted file or else an env var.

    The file is re-read when its modification time changes (checked at most
    every ``reload_interval_s``), so a rotated Kubernetes Secret takes effect
    without a restart. Only SHA-256 digests of the keys are kept.
    """

    def __init__(
        self,
        keys_file: str | None,
        keys_env: str,
        *,
        reload_interval_s: float = 10.0,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self._file = keys_file
        self._env = keys_env
        self._environ = os.environ if environ is None else environ
        self._reload_interval_s = reload_interval_s
        self._digests: tuple[bytes, ...] = ()
        self._source = "none"
        self._file_mtime: float | None = None
        self._checked_at = float("-inf")
        self._load()

    @property
    def source(self) -> str:
        """Where the keys came from: "file", "env" or "none" (never the keys)."""
        return self._source

    def __len__(self) -> int:
        return len(self._digests)

    def _file_mtime_now(self) -> float | None:
        if not self._file:
            return None
        try:
            return os.stat(self._file).st_mtime
        except OSError:
            return None

    def _load(self) -> None:
        mtime = self._file_mtime_now()
        keys: list[str] = []
        source = "none"
        if mtime is not None and self._file:
            try:
                with open(self._file, encoding="utf-8") as handle:
                    keys = parse_keys_file(handle.read())
                source = "file"
            except OSError as exc:
                logger.warning("API key file %s could not be read: %s", self._file, exc.strerror)
        if not keys:
            keys = parse_keys_env(self._environ.get(self._env, ""))
            source = "env" if keys else "none"
        self._digests = tuple(_digest(k) for k in keys)
        self._file_mtime = mtime
        if source != self._source or not keys:
            logger.info("API keys loaded from %s: %d key(s)", source, len(keys))
        self._source = source

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self._reload_interval_s:
            return
        self._checked_at = now
        if self._file_mtime_now() != self._file_mtime:
            self._load()

    def verify(self, presented: str | None) -> bool:
        """True when ``presented`` equals one of the keys.

        Digests of equal length are compared with ``hmac.compare_digest``
        against every key, so neither the key's length nor its position in
        the list shows in the time taken.
        """
        self._maybe_reload()
        if not presented:
            return False
        candidate = _digest(presented)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            header: str = bytes(value).decode("latin-1")
            scheme, _, token = header.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


@dataclass(frozen=True)
class LimitViolation:
    message: str
    param: str
    code: str


def _text_bytes(content: Any) -> int:
    """UTF-8 bytes of the text in a message ``content`` (a string or a list of parts)."""
    if isinstance(content, str):
        return len(content.encode())
    total = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"].encode())
            elif isinstance(part, str):
                total += len(part.encode())
    return total


def prompt_token_bound(path: str, body: dict[str, Any]) -> tuple[int, bool] | None:
    """An upper bound on the prompt tokens of a request, and whether it is exact.

    For a completion with several prompts the largest one counts, since each
    is served as its own sequence. Returns None when the body has no prompt
    this module understands (the engine validates it then).
    """
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt.encode()) + 2, False
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return len(prompt), True
            if all(isinstance(p, list) for p in prompt):
                return max(len(p) for p in prompt), True
            if all(isinstance(p, str) for p in prompt):
                return max(len(p.encode()) for p in prompt) + 2, False
        return None
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        total = CHAT_TEMPLATE_TOKENS
        for message in messages:
            if not isinstance(message, dict):
                return None
            total += CHAT_TOKENS_PER_MESSAGE + _text_bytes(message.get("content"))
            for key in ("role", "name", "reasoning_content", "tool_call_id"):
                value = message.get(key)
                if isinstance(value, str):
                    total += len(value.encode())
            if message.get("tool_calls"):
                total += len(json.dumps(message["tool_calls"]).encode())
        if body.get("tools"):
            total += len(json.dumps(body["tools"]).encode())
        return total, False
    return None


def check_max_tokens(body: dict[str, Any], limits: RequestLimits) -> LimitViolation | None:
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_tokens:
            return LimitViolation(
                message=(f"{param} is {value}, but this server accepts at most {limits.max_tokens}. Lower {param}."),
                param=param,
                code="max_tokens_exceeded",
            )
    return None


def prompt_violation(tokens: int, limits: RequestLimits) -> LimitViolation | None:
    if tokens > limits.max_prompt_tokens:
        return LimitViolation(
            message=(
                f"The prompt has {tokens} tokens, but this server accepts at most "
                f"{limits.max_prompt_tokens}. Shorten the prompt."
            ),
            param="messages",
            code="context_length_exceeded",
        )
    return None


class ApiGuard:
    """ASGI middleware: API-key authentication, then request limits.

    * Every HTTP route but :data:`OPEN_PATHS` (and CORS preflights) needs
      ``Authorization: Bearer <key>``; otherwise 401 with an OpenAI error body.
    * On the completion routes, ``max_tokens``/``max_completion_tokens`` above
      ``limits.max_tokens`` and prompts above ``limits.max_prompt_tokens`` get
      400. The prompt check costs nothing for prompts whose byte count already
      fits; only larger ones are counted exactly, by ``count_prompt_tokens``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys,
        limits: RequestLimits,
        count_prompt_tokens: PromptTokenCounter | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits
        self.count_prompt_tokens = count_prompt_tokens
        self.max_body_bytes = max_body_bytes

    @staticmethod
    def _path(scope: Scope) -> str:
        path: str = scope.get("path", "")
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/")
        return path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = self._path(scope)
        method = scope.get("method", "GET")
        if path in OPEN_PATHS or path.startswith("/-/") or method == "OPTIONS":
            await self.app(scope, receive, send)
            return

        if not self.keys.verify(bearer_token(scope)):
            await send_json(
                send,
                401,
                error_body(
                    "Missing or invalid API key. Send it as 'Authorization: Bearer <key>'.",
                    type_="invalid_request_error",
                    param=None,
                    code="invalid_api_key",
                ),
                [(b"www-authenticate", b'Bearer realm="inference"')],
            )
            return

        if method != "POST" or path not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return

        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        violation = await self._check_limits(path, body)
        if violation is not None:
            await send_json(
                send,
                400,
                error_body(
                    violation.message,
                    type_="invalid_request_error",
                    param=violation.param,
                    code=violation.code,
                ),
            )
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_json(
                    send,
                    413,
                    error_body(
                        f"Request body larger than {self.max_body_bytes} bytes.",
                        type_="invalid_request_error",
                        param=None,
                        code="request_too_large",
                    ),
                )
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _check_limits(self, path: str, raw: bytes) -> LimitViolation | None:
        try:
            body = json.loads(raw)
        except ValueError:
            return None  # the route answers malformed JSON itself
        if not isinstance(body, dict):
            return None
        violation = check_max_tokens(body, self.limits)
        if violation is not None:
            return violation
        bound = prompt_token_bound(path, body)
        if bound is None:
            return None
        tokens, exact = bound
        if tokens <= self.limits.max_prompt_tokens:
            return None
        if not exact:
            if self.count_prompt_tokens is None:
                return None
            try:
                counted = await self.count_prompt_tokens(path, body)
            except Exception:
                logger.warning("Exact prompt token count failed; leaving the check to the engine", exc_info=True)
                return None
            if counted is None:
                return None
            tokens = counted
        violation = prompt_violation(tokens, self.limits)
        if violation is not None and path == COMPLETIONS_PATH:
            violation = LimitViolation(violation.message, "prompt", violation.code)
        return violation


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body over once, then defers to the original."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
