"""What vllm-router forwards to a replica: every body passes the API-key guard, and vLLM gets only its own fields.

The router (the release requirements-dev.txt pins) runs as its own process in
front of two stand-in replicas that keep each body they are sent. The router
parses every request into its own request type and serializes it back, so it
adds fields the client never sent; the guard accepts those at the router's
values only (request_policy.ROUTER_VALUES), and a client's own value, which
the router passes unchanged, is refused.
"""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from inference_server.request_policy import CHAT_PATH, COMPLETIONS_PATH, ROUTER_ONLY_FIELDS, check_fields
from inference_server.vllm_guard import SETTINGS_ENV, VllmServerGuard
from pydantic import BaseModel

from localserve.processes import free_port
from tests.e2e.loopback_http import LoopbackHttp, answer
from tests.guard_calls import Recorder, call, make_guard, send_to

ROOT = Path(__file__).resolve().parent.parent

# Exactly what vllm-router 0.1.17 adds to a body that leaves these fields out:
# `stream` and the request type's defaults. Seen the same with every policy
# that does not ask a replica to render the prompt first, streaming or not.
ROUTER_ADDS: dict[str, dict[str, Any]] = {
    CHAT_PATH: {
        "stream": False,
        "logprobs": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "include_reasoning": True,
    },
    COMPLETIONS_PATH: {
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
}

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 4}
FULL_CHAT: dict[str, Any] = {
    **CHAT,
    "messages": [
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_object"},
    "logprobs": True,
    "top_logprobs": 2,
    "n": 2,
    "temperature": 0.2,
    "top_k": 5,
    "stop": ["\n"],
    "seed": 7,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "add_generation_prompt": True,
    "return_token_ids": True,
}
FULL_COMPLETION = {**COMPLETION, "prompt": [[1, 2, 3], [4, 5]], "echo": True, "logprobs": 2, "stream": True}
STREAMS: list[dict[str, Any]] = [
    {"stream": True},
    {"stream": False},
    {"stream": True, "stream_options": {"include_usage": True}},
]
# Sent as clients would, the router passing them on.
ORDINARY = [
    (CHAT_PATH, CHAT),
    *((CHAT_PATH, {**CHAT, **s}) for s in STREAMS),
    (CHAT_PATH, FULL_CHAT),
    (COMPLETIONS_PATH, COMPLETION),
    *((COMPLETIONS_PATH, {**COMPLETION, **s}) for s in STREAMS),
    (COMPLETIONS_PATH, FULL_COMPLETION),
]
# A client's own values for the router's fields: the router does not overwrite them.
CLIENT_VALUES = [
    (CHAT_PATH, "return_hidden_states", True),
    (CHAT_PATH, "separate_reasoning", False),
    (CHAT_PATH, "include_reasoning", False),
    (COMPLETIONS_PATH, "no_stop_trim", True),
]

Forwarded = list[tuple[str, dict[str, Any], dict[str, Any]]]


def _pinned_router(requirements: str = "requirements-dev.txt") -> str:
    match = re.search(r"^vllm-router==(\S+)$", (ROOT / requirements).read_text(), re.MULTILINE)
    assert match, f"{requirements} pins no vllm-router"
    return match[1]


def test_the_tests_run_the_router_release_the_image_carries() -> None:
    assert _pinned_router() == _pinned_router("workloads/requirements.txt")


@pytest.fixture(scope="module")
def router_cli() -> Any:
    return pytest.importorskip(
        "vllm_router.launch_router", reason="vllm-router is a test dependency: pip install -r requirements-dev.txt"
    )


def _replica(seen: list[tuple[str, dict[str, Any]]]) -> LoopbackHttp:
    """A stand-in replica: healthy, it keeps each body and answers as vLLM would, streamed or not."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _answer(self, data: bytes, content_type: str) -> None:
            answer(self, 200, data, content_type)

        def do_GET(self) -> None:
            self._answer(b"{}", "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            seen.append((self.path, body))
            if body.get("stream") is True:
                self._answer(b'data: {"id":"x","choices":[]}\n\ndata: [DONE]\n\n', "text/event-stream")
            else:
                self._answer(b'{"id":"x","object":"text_completion","choices":[]}', "application/json")

    return LoopbackHttp(Handler)


def _post(base: str, path: str, body: dict[str, Any]) -> None:
    headers = {"Authorization": "Bearer client-key", "Content-Type": "application/json"}
    request = urllib.request.Request(base + path, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        answer.read()


@pytest.fixture(scope="module")
def forwarded(router_cli: Any) -> Iterator[tuple[Forwarded, Forwarded]]:
    """(path, body sent, body a replica got) for the ordinary requests, then for the clients' own values."""
    seen: list[tuple[str, dict[str, Any]]] = []
    replicas = [_replica(seen) for _ in range(2)]
    port = free_port()
    router = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port)),
            "--worker-urls",
            *(r.base_url for r in replicas),
            # power_of_two (the policy needs two replicas); the bodies are the same with the other
            # policies that do not render the prompt on a replica first.
            *("--policy", "power_of_two", "--prometheus-port", str(free_port())),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/liveness", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and router.poll() is None, "the router did not start"
                time.sleep(0.2)
        results: tuple[Forwarded, Forwarded] = ([], [])
        client_values = [(path, {**(CHAT if path == CHAT_PATH else COMPLETION), f: v}) for path, f, v in CLIENT_VALUES]
        for requests, into in ((ORDINARY, results[0]), (client_values, results[1])):
            for path, body in requests:
                seen.clear()
                _post(base, path, body)
                ((got_path, got),) = seen
                into.append((got_path, body, got))
        yield results
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
        for replica in replicas:
            replica.stop()


def test_the_installed_router_is_the_pinned_one(router_cli: Any) -> None:
    assert version("vllm-router") == _pinned_router(), "pip install -r requirements-dev.txt"


def test_the_router_adds_these_fields_and_keeps_every_value_the_client_sent(
    forwarded: tuple[Forwarded, Forwarded],
) -> None:
    ordinary, client_values = forwarded
    for path, sent, got in ordinary + client_values:
        assert got == {**ROUTER_ADDS[path], **sent}, path


def test_every_body_the_router_forwards_passes_the_guard_and_vllm_knows_every_field_left(
    forwarded: tuple[Forwarded, Forwarded],
) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    models: dict[str, type[BaseModel]] = {CHAT_PATH: ChatCompletionRequest, COMPLETIONS_PATH: CompletionRequest}
    ordinary, _ = forwarded
    guard, downstream = make_guard(max_tokens=64)
    for path, _, got in ordinary:
        assert check_fields(path, got) is None, (path, got)
        answer = call(guard, path, body=got)
        assert answer.status == 200, (path, answer.raw[:300])
        passed_on = json.loads(downstream.calls[-1][1])
        assert passed_on == {k: v for k, v in got.items() if k not in ROUTER_ONLY_FIELDS}
        # No field vLLM's request model would keep as an extra it never reads.
        assert models[path].model_validate(passed_on).model_extra == {}, path


def test_the_vllm_server_guard_takes_every_body_the_router_forwards(
    forwarded: tuple[Forwarded, Forwarded], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    settings = {"api_keys_file": str(keys), "api_keys_env": "UNUSED", "limits": {"max_tokens": 64}, "model_ids": ["m"]}
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(settings))
    downstream = Recorder(body=b"{}")
    app = VllmServerGuard(downstream)
    ordinary, _ = forwarded
    for path, _, got in ordinary:
        status, doc = send_to(app, path, body=got)
        assert status == 200, (path, doc)
        assert json.loads(downstream.calls[-1][1]) == {k: v for k, v in got.items() if k not in ROUTER_ONLY_FIELDS}


def test_a_clients_own_value_of_a_router_field_is_refused(forwarded: tuple[Forwarded, Forwarded]) -> None:
    _, client_values = forwarded
    for (path, field, value), (_, _, got) in zip(CLIENT_VALUES, client_values, strict=True):
        assert got[field] is value
        refusal = check_fields(path, got)
        assert refusal is not None and (refusal.param, refusal.code) == (field, "unsupported_value"), refusal
