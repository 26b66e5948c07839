"""What the end-to-end tests share about a client's view of the server: its key header and the error shape."""

from __future__ import annotations

import json
from typing import Any

import httpx

from .conftest import ServerInfo

# Words that would show the server's internals leaking into an error a client reads.
INTERNAL_WORDS = ("traceback", "exception", "internal", "serializable", "object of type", "ray.llm", "vllm.")


def headers(server: ServerInfo, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}", **extra}


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The status, and a body of exactly {"error": {message, type, param, code}} without internals."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    doc = response.json()
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    text = json.dumps(error).lower()
    assert not any(word in text for word in INTERNAL_WORDS), error
    return dict(error)
