"""End-to-end: client mistakes against the real server get a 4xx with an OpenAI error body, never a 500.

Each class of bad request is sent over plain HTTP (raw sockets where a
client library would tidy the request up) to the server that the session
fixture started, in each layout. The guard decides most of them
before Ray Serve LLM or vLLM sees the request; the rest are answered by the
routes and reshaped by the guard on the way out.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from localserve.server import LIMIT_MAX_PROMPT_TOKENS, LIMIT_MAX_TOKENS

from .conftest import ServerInfo
from .openai_errors import assert_openai_error, headers

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0
# The cap the guard derives for the local server's limits: the 1 MiB floor.
BODY_CAP = 1024 * 1024


def post(server: ServerInfo, path: str, content: bytes, content_type: str | None) -> httpx.Response:
    extra = {"Content-Type": content_type} if content_type is not None else {}
    return httpx.post(server.base_url + path, content=content, headers=headers(server, **extra), timeout=TIMEOUT_S)


def completion(server: ServerInfo, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_id, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(server: ServerInfo, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


# ---------------------------------------------------------------- raw HTTP/1.1


def _address(server: ServerInfo) -> tuple[str, int, str]:
    url = urlsplit(server.base_url)
    assert url.hostname and url.port
    return url.hostname, url.port, url.path


def _read_status(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """The status code and everything read until the head and body have arrived (or the peer closed)."""
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                None,
            )
            if length is None or len(body) >= length:
                break
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    return int(data.split(b" ", 2)[1]), data


@pytest.fixture
def raw_socket(server: ServerInfo) -> Iterator[socket.socket]:
    host, port, _ = _address(server)
    sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
    try:
        yield sock
    finally:
        sock.close()


# ---------------------------------------------------------------- 415, 400: the body


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", None], ids=["text-plain", "form", "none"]
)
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_valid_body_with_the_wrong_content_type_gets_415(
    server: ServerInfo, content_type: str | None, path: str
) -> None:
    body = completion(server) if path == "/completions" else chat(server)
    response = post(server, path, json.dumps(body).encode(), content_type)
    error = assert_openai_error(response, 415)
    assert error["code"] == "unsupported_media_type"


def test_curl_dash_d_gets_415(server: ServerInfo, raw_socket: socket.socket) -> None:
    # What `curl -d '{...}'` sends: the JSON as a form, no other headers.
    host, port, prefix = _address(server)
    body = json.dumps(completion(server)).encode()
    raw_socket.sendall(
        f"POST {prefix}/completions HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    status, data = _read_status(raw_socket, time.monotonic() + TIMEOUT_S)
    assert status == 415, data[:500]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "MODEL", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}',
        b'{"model": "MODEL", "prompt": "Hi", "max_tokens": 2, "temperature": Infinity}',
        b'{"model": "MODEL", "prompt": "Hi", "max_tokens": 2, "top_p": -Infinity}',
        b'{"model": "MODEL", "prompt": "Hi", "max_tokens": 2, "temperature": 1e999}',
        b'{"model": "MODEL", "prompt": ',
        b'["MODEL"]',
        b"",
        b"\xff\xfe\x00{",
    ],
    ids=["nan", "infinity", "minus-infinity", "overflow", "truncated", "array", "empty", "not-utf8"],
)
def test_a_body_that_is_not_a_json_object_gets_400(server: ServerInfo, raw: bytes) -> None:
    response = post(server, "/completions", raw.replace(b"MODEL", server.model_id.encode()), "application/json")
    error = assert_openai_error(response, 400)
    assert error["code"] == "invalid_json"


def test_a_request_the_route_refuses_is_reshaped(server: ServerInfo) -> None:
    # Valid JSON of the wrong shape: the route's own validation answers, the guard reshapes it.
    response = post(server, "/chat/completions", json.dumps(chat(server, messages="hi")).encode(), "application/json")
    error = assert_openai_error(response, 400)
    assert error["param"] == "messages"
    response = httpx.get(server.base_url + "/no-such-route", headers=headers(server), timeout=TIMEOUT_S)
    assert_openai_error(response, 404)


# ---------------------------------------------------------------- 413: the size


def test_a_declared_body_over_the_cap_gets_413_before_it_is_sent(server: ServerInfo, raw_socket: socket.socket) -> None:
    host, port, prefix = _address(server)
    raw_socket.sendall(
        f"POST {prefix}/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {64 * 1024 * 1024}\r\n\r\n".encode()
    )
    # Not a byte of the body is sent: the answer comes from the header alone.
    status, data = _read_status(raw_socket, time.monotonic() + 30)
    assert status == 413, data[:500]
    error = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large"


def test_a_chunked_body_over_the_cap_gets_413(server: ServerInfo, raw_socket: socket.socket) -> None:
    host, port, prefix = _address(server)
    raw_socket.sendall(
        f"POST {prefix}/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b'{"prompt": "' + b"a" * (256 * 1024)
    sent = 0
    try:
        # Twice the cap at most; the server may answer and close well before.
        while sent < 2 * BODY_CAP:
            raw_socket.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
            chunk = b"a" * (256 * 1024)
    except OSError:
        pass  # the server answered and closed the connection while the body was still coming
    status, data = _read_status(raw_socket, time.monotonic() + 30)
    assert status == 413, data[:500]


def test_a_body_under_the_cap_is_served(server: ServerInfo) -> None:
    response = httpx.post(
        server.base_url + "/completions", json=completion(server), headers=headers(server), timeout=TIMEOUT_S
    )
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------- 404: the model


def test_an_unknown_model_gets_an_openai_404(server: ServerInfo) -> None:
    for path, body in (("/completions", completion(server)), ("/chat/completions", chat(server))):
        response = httpx.post(
            server.base_url + path, json={**body, "model": "gpt-nope"}, headers=headers(server), timeout=TIMEOUT_S
        )
        error = assert_openai_error(response, 404)
        assert (error["code"], error["param"]) == ("model_not_found", "model")
    response = httpx.get(server.base_url + "/models/gpt-nope", headers=headers(server), timeout=TIMEOUT_S)
    assert assert_openai_error(response, 404)["code"] == "model_not_found"
    api = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


# ---------------------------------------------------------------- 400: the limits


@pytest.mark.parametrize("value", ["100000", 100000.0, str(LIMIT_MAX_TOKENS), 2.0, True], ids=repr)
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_must_be_an_integer(server: ServerInfo, param: str, value: Any) -> None:
    response = httpx.post(
        server.base_url + "/chat/completions",
        json={**chat(server), "max_tokens": None, param: value},
        headers=headers(server),
        timeout=TIMEOUT_S,
    )
    error = assert_openai_error(response, 400)
    assert (error["param"], error["code"]) == (param, "invalid_type")


# best_of is refused as a field vLLM 0.29 drops (tests/e2e/test_attacks_e2e.py covers the allow-list).
@pytest.mark.parametrize(("param", "code"), [("n", "too_many_choices"), ("best_of", "unsupported_parameter")])
def test_too_many_choices_are_refused(server: ServerInfo, param: str, code: str) -> None:
    response = httpx.post(
        server.base_url + "/completions",
        json=completion(server, **{param: 64}),
        headers=headers(server),
        timeout=TIMEOUT_S,
    )
    error = assert_openai_error(response, 400)
    assert (error["param"], error["code"]) == (param, code)


def test_n_within_the_limit_is_served(server: ServerInfo) -> None:
    api = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, timeout=TIMEOUT_S, max_retries=0)
    result = api.completions.create(model=server.model_id, prompt="Hello", max_tokens=4, n=2)
    assert len(result.choices) == 2
    # n x max_tokens over the request's budget (max_tokens x max_n) is refused.
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=server.model_id, prompt=["a"] * 5, max_tokens=LIMIT_MAX_TOKENS)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "output_tokens_exceeded"


def test_token_array_prompts_are_counted_and_capped(server: ServerInfo) -> None:
    over = [[7] * 3, [7] * (LIMIT_MAX_PROMPT_TOKENS + 1)]
    response = httpx.post(
        server.base_url + "/completions",
        json=completion(server, prompt=over),
        headers=headers(server),
        timeout=TIMEOUT_S,
    )
    assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"
    for bad in ([], [7, "a"], [[7], [7.5]]):
        response = httpx.post(
            server.base_url + "/completions",
            json=completion(server, prompt=bad),
            headers=headers(server),
            timeout=TIMEOUT_S,
        )
        assert assert_openai_error(response, 400)["code"] == "invalid_prompt"
    ok = httpx.post(
        server.base_url + "/completions",
        json=completion(server, prompt=[[7] * 5, [8] * 5]),
        headers=headers(server),
        timeout=TIMEOUT_S,
    )
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 2


def test_a_huge_prompt_is_refused_without_tokenizing(server: ServerInfo) -> None:
    # Well under the body cap, far over max_prompt_tokens x 16 bytes: refused from its length alone.
    prompt = "lorem ipsum " * 80_000
    started = time.monotonic()
    response = httpx.post(
        server.base_url + "/completions",
        json=completion(server, prompt=prompt),
        headers=headers(server),
        timeout=TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and "bytes" in error["message"]
    assert elapsed < 5, elapsed


# ---------------------------------------------------------------- keys on every kind of request


def test_options_without_a_key_is_refused(server: ServerInfo) -> None:
    preflight = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST"}
    response = httpx.options(server.base_url + "/chat/completions", headers=preflight, timeout=TIMEOUT_S)
    error = assert_openai_error(response, 401)
    assert error["code"] == "invalid_api_key"
    with_key = httpx.options(
        server.base_url + "/chat/completions", headers={**preflight, **headers(server)}, timeout=TIMEOUT_S
    )
    assert with_key.status_code != 401


def test_a_websocket_is_refused(server: ServerInfo, raw_socket: socket.socket) -> None:
    host, port, prefix = _address(server)
    raw_socket.sendall(
        f"GET {prefix}/realtime HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {server.api_key}\r\n\r\n".encode()
    )
    status, data = _read_status(raw_socket, time.monotonic() + 30)
    assert status == 403, data[:300]
