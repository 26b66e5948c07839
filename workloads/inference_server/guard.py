"""API keys, request checks and OpenAI-shaped errors, as one pure ASGI middleware.

This module needs only the standard library and the catalogue (pydantic), so it
is cheap to import and to test. The server installs :class:`ApiGuard` as the
outermost middleware of the OpenAI-compatible FastAPI app that Ray Serve LLM
builds (or, as ``VllmServerGuard``, of vLLM's own app in the vllm-server
layout), so every check runs in the same process as the routes and before any
of their handlers.

What the guard promises, in order:

1. A WebSocket is refused (the API has none, and no limit could be applied to one).
2. A body declared larger than the cap (``Content-Length``) gets 413 before a
   byte of it is read; a chunked body is cut off at the cap while it streams.
3. Every route but the health routes needs ``Authorization: Bearer <key>`` (401),
   ``OPTIONS`` included.
4. A ``POST`` body must be ``application/json`` (415), valid UTF-8 JSON
   without ``NaN``/``Infinity`` (400) and an object (400); a ``model`` the
   catalogue does not serve gets 404.
5. On the generation routes, only the fields and content parts of the
   request policy (:mod:`.request_policy`) are accepted (the router's own
   fields at its values only, and those vLLM does not define are removed from
   the body passed on); integer parameters must be JSON integers; and
   ``max_tokens``, ``n``, logprobs, the number of prompts, the request's
   total output and every prompt, counted exactly with the model's tokenizer
   and chat template, stay within
   :class:`~inference_server.catalog.RequestLimits` (400).
6. Any error the routes behind it answer is rewritten into the OpenAI shape
   ``{"error": {"message", "type", "param", "code"}}``; a 5xx never carries
   exception text.

Keys are never logged and never echoed back in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from . import request_policy as policy
from .api_keys import ApiKey, parse_keys_list, parse_keys_text
from .catalog import RequestLimits

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Counts the prompt tokens of one generation request exactly (the engine's own
# tokenizer and chat template), one count per prompt. Given the route path and
# the parsed JSON body; returns None when the engine could not tokenize it.
PromptTokenCounter = Callable[[str, dict[str, Any]], Awaitable[list[int] | None]]

# Routes that stay open: Serve's own health and route table, and the engine's
# health probe. Everything else needs a key, vLLM's /version too: no probe
# reads it, and it tells a scanner which engine release to aim at.
OPEN_PATHS = frozenset({"/-/healthz", "/-/routes", "/health", "/ping"})
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
LIMITED_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})
# vLLM's render routes take a generation request's body and answer its
# prompt as token ids, without generating: the request router's cache_aware
# policy asks them to match prompts to replica caches by token. The body is
# the generation request's, so it is checked as that request: same fields,
# same limits, the prompt counted the same way.
RENDER_PATHS = {COMPLETIONS_PATH + "/render": COMPLETIONS_PATH, CHAT_PATH + "/render": CHAT_PATH}
MODEL_PATH_PREFIX = "/v1/models/"
# Methods whose requests carry a body; every such route of the API takes JSON.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Parameters the engine reads as integers. Its request models coerce "100" and
# 100.0 to 100, which would slip past a check that looks only at ints.
INTEGER_PARAMS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")

# The cheap prompt bound: a token of a byte-level BPE or SentencePiece
# vocabulary covers at least one UTF-8 byte, so a prompt's byte count plus what
# a chat template adds around each message bounds its token count from above.
CHAT_TEMPLATE_TOKENS = 64
CHAT_TOKENS_PER_MESSAGE = 16

# The body cap. A prompt that passes the byte pre-check holds at most
# max_prompt_tokens x prompt_bytes_per_token bytes of text. JSON escaping at
# most doubles real text (a 3-byte character sent as a 6-byte \uXXXX escape),
# and a prompt sent as token ids costs at most 8 bytes a token ("128255,"),
# so twice the text bound holds the largest prompt the limits accept. The floor
# leaves room for long chat histories and tool schemas when the limits are
# small. With the defaults (32768 tokens x 16 bytes x 2) that is 1 MiB, the
# floor: json.loads takes about 20 ms for 1 MiB of token ids and 2 ms for
# 1 MiB of text on one core. A thread would not help, since the C decoder holds
# the GIL, so the cap is what keeps a parse from stalling the event loop.
MIN_BODY_BYTES = 1024 * 1024
JSON_ESCAPE_FACTOR = 2
# Error bodies from the routes behind the guard are small; a larger one passes unchanged.
MAX_ERROR_BODY_BYTES = 64 * 1024

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# Error types the OpenAI API itself uses; any other type from a route is replaced.
OPENAI_ERROR_TYPES = frozenset(
    {INVALID_REQUEST, SERVER_ERROR, "authentication_error", "permission_error", "not_found_error", "rate_limit_error"}
)


def body_cap(limits: RequestLimits) -> int:
    """The largest request body accepted (see :data:`MIN_BODY_BYTES` for the reasoning)."""
    return max(MIN_BODY_BYTES, limits.max_prompt_tokens * limits.prompt_bytes_per_token * JSON_ESCAPE_FACTOR)


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
    """The secrets of a mounted keys file (``[<id>:]<secret>`` a line, see :mod:`.api_keys`); bad lines are skipped."""
    return [key.secret for key in parse_keys_text(text)[0]]


def parse_keys_env(text: str) -> list[str]:
    """The secrets of an environment variable: ``[<id>:]<secret>`` entries, comma-separated."""
    return [key.secret for key in parse_keys_list(text)[0]]


# What a request without a valid key gets, wherever it is refused (the servers' guard, the gateway).
UNAUTHORIZED_CHALLENGE = b'Bearer realm="inference"'


def unauthorized_body() -> bytes:
    """The 401's body: the OpenAI error shape, naming how to send the key and never which keys exist."""
    return error_body(
        "Missing or invalid API key. Send it as 'Authorization: Bearer <key>'.",
        type_=INVALID_REQUEST,
        param=None,
        code="invalid_api_key",
    )


class ApiKeys:
    """The accepted API keys, read from a mounted file or else an env var.

    The file is re-read when its modification time changes (checked at most
    every ``reload_interval_s``), so a rotated Kubernetes Secret takes effect
    without a restart. Only SHA-256 digests of the keys are kept, each with
    its id (:mod:`.api_keys`), which :meth:`identify` returns.
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
        self._digests: tuple[tuple[bytes, str], ...] = ()
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
        keys: list[ApiKey] = []
        problems: list[str] = []
        source = "none"
        if mtime is not None and self._file:
            try:
                with open(self._file, encoding="utf-8") as handle:
                    keys, problems = parse_keys_text(handle.read())
                source = "file"
            except OSError as exc:
                logger.warning("API key file %s could not be read: %s", self._file, exc.strerror)
        if not keys:
            keys, problems = parse_keys_list(self._environ.get(self._env, ""))
            source = "env" if keys else "none"
        for problem in problems:
            # The messages name a line and an id, never a secret.
            logger.warning("API keys from %s: %s (skipped)", source, problem)
        self._digests = tuple((_digest(k.secret), k.id) for k in keys)
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
        """True when ``presented`` equals one of the keys."""
        return self.identify(presented) is not None

    def identify(self, presented: str | None) -> str | None:
        """The id of the key ``presented`` equals, or None.

        Digests of equal length are compared with ``hmac.compare_digest``
        against every key, so neither the key's length nor its position in
        the list shows in the time taken.
        """
        self._maybe_reload()
        if not presented:
            return None
        candidate = _digest(presented)
        matched: str | None = None
        for digest, key_id in self._digests:
            if hmac.compare_digest(candidate, digest):
                matched = key_id
        return matched


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: without the root path, without a trailing slash."""
    path: str = scope.get("path", "")
    root = scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    return path


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            header: str = bytes(value).decode("latin-1")
            scheme, _, token = header.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


# ---------------------------------------------------------------- refusals


@dataclass(frozen=True)
class Refusal:
    """A client mistake, answered with ``status`` and an OpenAI error body."""

    status: int
    message: str
    param: str | None
    code: str | None
    type: str = INVALID_REQUEST

    def body(self) -> bytes:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def _shown(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def check_content_type(scope: Scope) -> Refusal | None:
    """415 unless the body is declared as JSON in UTF-8, unencoded."""
    declared = _header(scope, b"content-type")
    media, _, params = (declared or "").partition(";")
    charset = ""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in ("", "utf-8", "utf8"):
        shown = f"'{_shown(declared)}'" if declared else "no Content-Type"
        return Refusal(
            415,
            f"The request body must be JSON sent with 'Content-Type: application/json'; this request has {shown}.",
            param=None,
            code="unsupported_media_type",
        )
    encoding = (_header(scope, b"content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        return Refusal(
            415,
            f"Content-Encoding '{_shown(encoding)}' is not accepted: send the JSON body uncompressed.",
            param=None,
            code="unsupported_media_type",
        )
    return None


def too_large(limit: int) -> Refusal:
    return Refusal(
        413,
        f"The request body is larger than this server accepts ({limit} bytes). Shorten the prompt.",
        param=None,
        code="request_too_large",
    )


def declared_length(scope: Scope) -> int | Refusal | None:
    """The body size in ``Content-Length``, a 400 for a malformed one, None when absent."""
    value = _header(scope, b"content-length")
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or len(value) > 18:
        return Refusal(400, "Content-Length must be a number of bytes.", param=None, code="invalid_content_length")
    return int(value)


class _NotFiniteError(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotFiniteError(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise _NotFiniteError(text)
    return value


# A \uD800-\uDFFF escape: JSON allows one without its pair, Python parses it
# to a lone surrogate, and that is not text (it can not be encoded as UTF-8,
# so counting or tokenizing it fails). Only bodies that hold one are checked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json_object(raw: bytes) -> dict[str, Any] | Refusal:
    """The body as a JSON object, or the 400 that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Refusal(400, "The request body is not valid UTF-8.", param=None, code="invalid_json")
    if not text.strip():
        return Refusal(400, "The request body is empty: send a JSON object.", param=None, code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NotFiniteError as err:
        return Refusal(
            400,
            f"The request body contains {_shown(str(err), 40)}, which is not a JSON number: "
            "send finite numbers only (no NaN or Infinity).",
            param=None,
            code="invalid_json",
        )
    except json.JSONDecodeError as err:
        return Refusal(
            400,
            f"The request body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno}).",
            param=None,
            code="invalid_json",
        )
    except (ValueError, RecursionError):
        # Integers of more than 4300 digits, arrays nested thousands deep.
        return Refusal(400, "The request body is not valid JSON.", param=None, code="invalid_json")
    if not isinstance(body, dict):
        return Refusal(
            400, f"The request body must be a JSON object, not {_json_kind(body)}.", param=None, code="invalid_json"
        )
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        return Refusal(
            400,
            "The request body holds a \\uD800-\\uDFFF escape without its pair, which is not text: "
            "send UTF-8 text or complete surrogate pairs.",
            param=None,
            code="invalid_json",
        )
    return body


def model_not_found(model: str) -> Refusal:
    return Refusal(
        404,
        f"The model '{_shown(model)}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def check_model(body: dict[str, Any], model_ids: Collection[str]) -> Refusal | None:
    """404 for a model the catalogue does not serve; a missing model is left to the route."""
    model = body.get("model")
    if model is None or not model_ids:
        return None
    if not isinstance(model, str):
        return Refusal(400, f"model must be a string, not {_json_kind(model)}.", param="model", code="invalid_type")
    if model not in model_ids:
        return model_not_found(model)
    return None


def check_integer_params(body: dict[str, Any]) -> Refusal | None:
    """400 for an integer parameter sent as a string, a decimal number or a boolean."""
    for param in INTEGER_PARAMS:
        value = body.get(param)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return Refusal(
                400,
                f"{param} must be an integer, not {_json_kind(value)}.",
                param=param,
                code="invalid_type",
            )
    return None


def check_choices(body: dict[str, Any], limits: RequestLimits) -> Refusal | None:
    """400 for ``n`` or ``best_of`` above ``limits.max_n`` (integers already checked)."""
    for param in ("n", "best_of"):
        value = body.get(param)
        if value is not None and value > limits.max_n:
            return Refusal(
                400,
                f"{param} is {value}, but this server accepts at most {limits.max_n}. Lower {param}.",
                param=param,
                code="too_many_choices",
            )
    return None


def check_max_tokens(body: dict[str, Any], limits: RequestLimits) -> Refusal | None:
    """400 for ``max_tokens``/``max_completion_tokens`` above the limit (integers already checked)."""
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is not None and value > limits.max_tokens:
            return Refusal(
                400,
                f"{param} is {value}, but this server accepts at most {limits.max_tokens}. Lower {param}.",
                param=param,
                code="max_tokens_exceeded",
            )
    return None


def check_output_budget(body: dict[str, Any], limits: RequestLimits, prompts: int = 1) -> Refusal | None:
    """400 when prompts x choices x max_tokens exceeds what one request may generate.

    A request that leaves max_tokens out may generate the server's limit
    (the engine's default is set to it), so that is what it is charged.
    """
    choices = max(body.get("n") or 1, body.get("best_of") or 1, 1)
    asked = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens")) if v is not None]
    per_choice = max(asked) if asked else limits.max_tokens
    total = prompts * choices * max(per_choice, 0)
    budget = limits.output_token_budget
    if total > budget:
        shape = f"{prompts} prompts x " if prompts > 1 else ""
        return Refusal(
            400,
            f"This request may generate {total} tokens ({shape}{choices} choices x {per_choice} max_tokens), "
            f"but this server allows at most {budget} per request. Lower n, best_of or max_tokens.",
            param="n" if choices > 1 else "prompt",
            code="output_tokens_exceeded",
        )
    return None


# ---------------------------------------------------------------- prompt size


@dataclass(frozen=True)
class PromptSize:
    """How big one prompt is: its text bytes and a bound on its tokens (exact for token ids)."""

    text_bytes: int
    tokens: int
    exact: bool


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def completion_prompts(prompt: Any) -> list[PromptSize] | Refusal:
    """Each prompt of a completion request, sized; 400 for a shape the API does not define."""
    bad = Refusal(
        400,
        "prompt must be a string, an array of strings, an array of token ids or an array of token id arrays.",
        param="prompt",
        code="invalid_prompt",
    )
    if isinstance(prompt, str):
        size = len(prompt.encode())
        return [PromptSize(size, size + 2, False)]
    if not isinstance(prompt, list):
        return bad
    if not prompt:
        return Refusal(400, "prompt must not be an empty array.", param="prompt", code="invalid_prompt")
    if all(_is_token(t) for t in prompt):
        return [PromptSize(0, len(prompt), True)]
    if all(isinstance(p, str) for p in prompt):
        return [PromptSize(len(p.encode()), len(p.encode()) + 2, False) for p in prompt]
    if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return [PromptSize(0, len(p), True) for p in prompt]
    return bad


def chat_prompt(body: dict[str, Any]) -> PromptSize | None:
    """The size of a chat request's prompt, or None when ``messages`` is not a list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None  # the route's own validation answers with a 400
    text = 0
    for message in messages:
        text += _text_bytes(message.get("content"))
        for key in ("role", "name", "reasoning_content", "tool_call_id"):
            value = message.get(key)
            if isinstance(value, str):
                text += len(value.encode())
        if message.get("tool_calls"):
            text += len(json.dumps(message["tool_calls"]).encode())
    if body.get("tools"):
        text += len(json.dumps(body["tools"]).encode())
    tokens = text + CHAT_TEMPLATE_TOKENS + CHAT_TOKENS_PER_MESSAGE * len(messages)
    return PromptSize(text, tokens, False)


def prompt_sizes(path: str, body: dict[str, Any]) -> list[PromptSize] | Refusal | None:
    """The sizes of a generation request's prompts; None when there is nothing this module understands."""
    if path == COMPLETIONS_PATH:
        if "prompt" not in body:
            return None
        return completion_prompts(body["prompt"])
    if path == CHAT_PATH:
        size = chat_prompt(body)
        return None if size is None else [size]
    return None


# ---------------------------------------------------------------- errors from the routes

# Ray Serve LLM's error messages look like
# "Message: <text> (Request ID: <id>), Internal exception: ..., original exception: ...".
_RAY_MESSAGE = re.compile(r"^Message: (?P<message>.*?)(?: \(Request ID: (?P<rid>[^)]*)\))?, Internal exception: ", re.S)
_REQUEST_ID = re.compile(r"\(Request ID: (?P<rid>[A-Za-z0-9-]{1,64})\)")
# Where Ray Serve LLM's validation errors say the problem is: "... at ('body', 'messages')".
_RAY_LOC = re.compile(r"at \('body', '(?P<param>[A-Za-z_][A-Za-z0-9_]{0,63})'")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\[\]]{0,63}$")
_STATUS_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
}
_SERVER_MESSAGES = {
    502: "The server could not reach the model. Please retry your request.",
    503: "The server is overloaded or not ready yet. Please retry your request.",
    504: "The model did not answer in time. Please retry your request.",
}
_SERVER_FAULT = "The server had an error while processing your request."


def server_message(status: int) -> str:
    """The fixed message of a 5xx answer: what went wrong behind the API is never shown to its caller."""
    return _SERVER_MESSAGES.get(status, _SERVER_FAULT)


def openai_error(status: int, raw: bytes) -> bytes:
    """Any error body a route answered with, rewritten into the OpenAI shape.

    Messages of 4xx answers are kept (Ray Serve LLM's internal exception
    text is cut off); a 5xx answer gets a fixed message, so exception text
    never reaches a client. The request id stays, to find the server's log.
    """
    try:
        payload: Any = json.loads(raw)
    except (ValueError, RecursionError):
        payload = None
    error: dict[str, Any] = {}
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict):
            error = inner
        elif isinstance(payload.get("detail"), str):  # FastAPI's HTTPException
            error = {"message": payload["detail"]}
        elif isinstance(payload.get("message"), str):
            error = payload
    message = error["message"] if isinstance(error.get("message"), str) else ""
    request_id = None
    ray = _RAY_MESSAGE.match(message)
    if ray:
        message, request_id = ray.group("message"), ray.group("rid")
    else:
        found = _REQUEST_ID.search(message)
        request_id = found.group("rid") if found else None
        message = _REQUEST_ID.sub("", message).strip()
    param = error.get("param")
    if not (isinstance(param, str) and _IDENTIFIER.match(param)):
        param = None
    loc = _RAY_LOC.search(message)
    if loc:
        param = loc.group("param")
    elif param and param.startswith("body."):
        param = param.removeprefix("body.") or None
    code = error.get("code")
    if not (isinstance(code, str) and _IDENTIFIER.match(code)):
        code = _STATUS_CODES.get(status)
    if status >= 500:
        type_ = SERVER_ERROR
        message = server_message(status)
    else:
        given = error.get("type")
        type_ = given if given in OPENAI_ERROR_TYPES else INVALID_REQUEST
        message = _shown(message, 2000) or f"The request failed with HTTP {status}."
    if request_id:
        message = f"{message} (Request ID: {request_id})"
    return error_body(message, type_=type_, param=param, code=code)


def _shape_errors(send: Send, method: str) -> Send:
    """A ``send`` that rewrites error answers (status >= 400) into the OpenAI shape."""
    held: Message | None = None
    chunks: list[bytes] = []
    size = 0

    def shaped(message: Message) -> Awaitable[None]:
        # A plain function that hands back the next `send`'s awaitable: a
        # successful stream's every token passes here, and a coroutine of its
        # own would cost a frame and an await on each.
        if held is None and message["type"] != "http.response.start":
            return send(message)
        return shaping(message)

    async def shaping(message: Message) -> None:
        # The start, and what follows a start held back (`shaped` passes the rest).
        nonlocal held, size
        kind = message["type"]
        if kind == "http.response.start":
            if int(message.get("status", 200)) >= 400 and method != "HEAD":
                held = message
                return
            await send(message)
            return
        assert held is not None
        if kind != "http.response.body":
            start, held = held, None
            await send(start)
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
            await send(message)
            return
        body = bytes(message.get("body", b""))
        chunks.append(body)
        size += len(body)
        more = bool(message.get("more_body", False))
        if size > MAX_ERROR_BODY_BYTES:
            start, held = held, None
            await send(start)
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": more})
            return
        if more:
            return
        start, held = held, None
        status = int(start["status"])
        new_body = openai_error(status, b"".join(chunks))
        headers = [
            (bytes(k), bytes(v))
            for k, v in start.get("headers") or ()
            if bytes(k).lower() not in (b"content-length", b"content-type", b"content-encoding")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new_body)).encode())]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": new_body, "more_body": False})

    return shaped


def _capped(receive: Receive, limit: int) -> Receive:
    """A ``receive`` that ends the request (as a disconnect) once its body passes ``limit`` bytes."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                return {"type": "http.disconnect"}
        return message

    return capped


def with_content_length(scope: Scope, length: int) -> Scope:
    """A copy of ``scope`` whose ``Content-Length`` header is ``length``: the body passed on is not the one read."""
    headers = [(k, v) for k, v in scope.get("headers") or () if bytes(k).lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


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


# ---------------------------------------------------------------- the middleware


def tokenize_requests(
    path: str, body: dict[str, Any], model: str | None, chat_request: Any, completion_request: Any
) -> list[Any]:
    """The tokenize requests that measure a generation request's prompt(s).

    Built with the serving library's own request models (Ray Serve LLM's or
    vLLM's, which take the same fields), so the count uses the model's chat
    template exactly as generation will.
    """
    if path == CHAT_PATH:
        continue_final = bool(body.get("continue_final_message", False))
        return [
            chat_request(
                model=model,
                messages=body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", not continue_final),
                continue_final_message=continue_final,
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        ]
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) else [prompt]
    return [completion_request(model=model, prompt=p) for p in prompts]


class ApiGuard:
    """ASGI middleware: API keys, request checks and OpenAI-shaped errors (see the module docstring).

    ``model_ids`` are the served model names (empty: not checked here).
    ``count_prompt_tokens`` counts a prompt exactly; it is asked only when
    the cheap byte bounds can not decide.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys,
        limits: RequestLimits,
        model_ids: Collection[str] = (),
        count_prompt_tokens: PromptTokenCounter | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits
        self.model_ids = frozenset(model_ids)
        self.count_prompt_tokens = count_prompt_tokens
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else body_cap(limits)

    _path = staticmethod(route_path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await _refuse_websocket(receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = self._path(scope)
        method = str(scope.get("method", "GET")).upper()

        declared = declared_length(scope)
        if isinstance(declared, Refusal):
            await send_json(send, declared.status, declared.body())
            return
        if declared is not None and declared > self.max_body_bytes:
            # Decided from the header alone: not a byte of the body is read.
            await send_json(send, 413, too_large(self.max_body_bytes).body())
            return

        if path in OPEN_PATHS or path.startswith("/-/"):
            await self.app(scope, _capped(receive, self.max_body_bytes), send)
            return

        if not self.keys.verify(bearer_token(scope)):
            await send_json(send, 401, unauthorized_body(), [(b"www-authenticate", UNAUTHORIZED_CHALLENGE)])
            return

        shaped_send = _shape_errors(send, method)
        if method not in BODY_METHODS:
            if method in ("GET", "HEAD") and path.startswith(MODEL_PATH_PREFIX) and self.model_ids:
                model = path[len(MODEL_PATH_PREFIX) :]
                # Ray Serve LLM spells "/" in a model id as "--" in this path.
                if model not in self.model_ids and model.replace("--", "/") not in self.model_ids:
                    missing = model_not_found(model)
                    await send_json(send, missing.status, missing.body())
                    return
            if policy.is_models_path(path):
                # vLLM's model cards name the weights' location (root).
                shaped_send = policy.without_weights_location(shaped_send)
            await self.app(scope, _capped(receive, self.max_body_bytes), shaped_send)
            return

        checked: Refusal | bytes | None = check_content_type(scope)
        if checked is None:
            raw = await self._read_body(receive)
            if raw is None:
                return  # the client went away
            if len(raw) > self.max_body_bytes:
                checked = too_large(self.max_body_bytes)
            else:
                checked = await self._check(path, raw)
                if isinstance(checked, bytes) and checked is not raw:
                    scope = with_content_length(scope, len(checked))
        if isinstance(checked, Refusal):
            await send_json(send, checked.status, checked.body())
            return
        assert checked is not None
        await self.app(scope, _replay(checked, receive), shaped_send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or no more than one chunk past the cap; None when the client disconnected."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            chunks.append(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    async def _check(self, path: str, raw: bytes) -> Refusal | bytes:
        """The refusal, or the body to pass on: ``raw`` itself unless the router's own fields were removed."""
        path = RENDER_PATHS.get(path, path)
        body = parse_json_object(raw)
        if isinstance(body, Refusal):
            return body
        refusal = await self._refusal(path, body)
        if refusal is not None:
            return refusal
        if policy.strip_router_fields(path, body):
            # Written again only then: about as long as parsing it took (~10 ms for 1 MiB of token ids).
            return policy.encode_body(body)
        return raw

    async def _refusal(self, path: str, body: dict[str, Any]) -> Refusal | None:
        refusal = check_model(body, self.model_ids)
        if refusal is not None or path not in LIMITED_PATHS:
            return refusal
        # The allow-list first: no field it refuses is read by a check below.
        refusal = _refused(policy.check_fields(path, body))
        if refusal is not None:
            return refusal
        refusal = check_integer_params(body) or check_choices(body, self.limits) or check_max_tokens(body, self.limits)
        if refusal is not None:
            return refusal
        refusal = _refused(policy.check_logprobs(path, body, self.limits))
        if refusal is not None:
            return refusal
        sizes = prompt_sizes(path, body)
        if isinstance(sizes, Refusal):
            return sizes
        refusal = _refused(policy.check_prompt_count(len(sizes) if sizes else 1, self.limits))
        if refusal is not None:
            return refusal
        refusal = check_output_budget(body, self.limits, prompts=len(sizes) if sizes else 1)
        if refusal is not None or sizes is None:
            return refusal
        decided = policy.plan_prompt_check(path, body, sizes, self.limits)
        if isinstance(decided, policy.PolicyError):
            return _refused(decided)
        if not decided or self.count_prompt_tokens is None:
            return None
        try:
            counted = await self.count_prompt_tokens(path, body)
        except ValueError as err:
            # The tokenize request models refused the prompt: so would generation's.
            logger.info("Prompt could not be tokenized: %s", type(err).__name__)
            counted = None
        except Exception:
            # Not counted is not served: an uncounted prompt is the very bypass the limits close.
            logger.warning("Exact prompt token count failed", exc_info=True)
            return Refusal(
                503,
                "The server could not measure the prompt. Please retry your request.",
                param=None,
                code="prompt_not_measured",
                type=SERVER_ERROR,
            )
        return _refused(policy.check_counted(path, body, counted, self.limits))


def _refused(error: policy.PolicyError | None) -> Refusal | None:
    """The guard's answer to a request the request policy refuses."""
    if error is None:
        return None
    return Refusal(error.status, error.message, param=error.param, code=error.code)


async def _refuse_websocket(receive: Receive, send: Send) -> None:
    """Close a WebSocket before accepting it: the server answers the upgrade with 403."""
    message = await receive()
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008, "reason": "WebSockets are not offered"})
