"""Per-key fairness and attribution without a server: key ids, in-flight caps, 429s, the access log, the counters.

The real server's proof is tests/e2e/test_fairness_e2e.py; the config and
capacity rules that hold the caps in bounds are at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import typing
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from inference_server.api_keys import (
    BATCH_WORKER_KEY_ID,
    ApiKey,
    KeyFormatError,
    fingerprint,
    keys_file,
    parse_entry,
    parse_keys_list,
    parse_keys_text,
)
from inference_server.catalog import Catalog, KeyFairness, RequestLimits
from inference_server.fairness import (
    MAX_EVENT_BYTES,
    STREAM_HOLD_BYTES,
    AccessLog,
    AnswerReader,
    InflightLimiter,
    KeyAccounting,
    PrometheusKeyMetrics,
)
from inference_server.guard import ApiGuard, ApiKeys, parse_keys_file
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from infra.capacity.geometry import resolve_geometry
from infra.capacity.plan import Device, EngineSettings, plan_replica
from infra.capacity.rules import MAX_INFLIGHT_KV_ROUNDS, inflight_problems
from infra.config import ConfigError, _check_api_keys, key_fairness, parse
from tests.harness import stack_config, stack_sections

SECRET_A = "alpha-secret-0123456789abcdef"
SECRET_B = "bravo-secret-0123456789abcdef"
SECRET_OLD = "legacysecret0123456789abcdef"
PROMPT = "the quick brown fox tells a secret story"
MODEL = "tiny"

# ---------------------------------------------------------------- key ids


def test_an_entry_is_id_colon_secret_and_a_bare_secret_gets_its_fingerprint() -> None:
    key = parse_entry(f"team-a:{SECRET_A}", "line 1")
    assert (key.id, key.secret, key.explicit) == ("team-a", SECRET_A, True)
    old = parse_entry(SECRET_OLD, "line 2")
    assert (old.id, old.secret, old.explicit) == (fingerprint(SECRET_OLD), SECRET_OLD, False)
    # Stable, short, and made of none of the secret's text.
    assert fingerprint(SECRET_OLD) == fingerprint(SECRET_OLD) != fingerprint(SECRET_A)
    assert fingerprint(SECRET_OLD).startswith("key-") and len(fingerprint(SECRET_OLD)) == 16
    assert SECRET_OLD[:6] not in fingerprint(SECRET_OLD)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f"Team A:{SECRET_A}", "the key id before ':' must be"),
        (f"-team:{SECRET_A}", "the key id before ':' must be"),
        ("team:", "has no secret after ':'"),
        (f"team:{SECRET_A}:extra", "may not contain ':'"),
    ],
)
def test_a_bad_entry_is_one_line_that_never_shows_the_secret(text: str, says: str) -> None:
    with pytest.raises(KeyFormatError) as info:
        parse_entry(text, "line 7")
    message = str(info.value)
    assert message.startswith("line 7: ") and says in message and "\n" not in message
    assert SECRET_A not in message and "extra" not in message


def test_a_key_never_shows_in_its_repr() -> None:
    key = ApiKey("team-a", SECRET_A)
    assert SECRET_A not in repr(key) and "team-a" in repr(key)


def test_the_keys_file_round_trips_and_skips_bad_lines() -> None:
    text = keys_file([ApiKey("team-a", SECRET_A), ApiKey(fingerprint(SECRET_OLD), SECRET_OLD, explicit=False)])
    assert text == f"team-a:{SECRET_A}\n{fingerprint(SECRET_OLD)}:{SECRET_OLD}\n"
    keys, problems = parse_keys_text(f"# comment\n\n{text}Bad:{SECRET_B}\n")
    assert [(k.id, k.secret) for k in keys] == [("team-a", SECRET_A), (fingerprint(SECRET_OLD), SECRET_OLD)]
    assert problems == ["line 5: the key id before ':' must be " + problems[0].split("must be ", 1)[1]]
    assert parse_keys_file(text) == [SECRET_A, SECRET_OLD]
    assert [k.id for k in parse_keys_list(f"a:{SECRET_A}, {SECRET_B}")[0]] == ["a", fingerprint(SECRET_B)]


def test_the_guard_names_the_key_it_accepts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(f"team-a:{SECRET_A}\n{SECRET_OLD}\nNOT AN ID:{SECRET_B}\n")
    with caplog.at_level(logging.INFO):
        keys = ApiKeys(str(path), "UNUSED", environ={})
    assert keys.identify(SECRET_A) == "team-a" and keys.verify(SECRET_A)
    assert keys.identify(SECRET_OLD) == fingerprint(SECRET_OLD)
    # The bad line is skipped with a warning naming its line, never its text.
    assert keys.identify(SECRET_B) is None and keys.identify(f"team-a:{SECRET_A}") is None
    assert keys.identify(None) is None and keys.identify("") is None
    assert "line 3" in caplog.text and SECRET_B not in caplog.text and SECRET_A not in caplog.text
    env = ApiKeys(None, "K", environ={"K": f"ci:{SECRET_B}"})
    assert env.identify(SECRET_B) == "ci"


# ---------------------------------------------------------------- in-flight caps


def test_the_limiter_holds_each_key_and_the_replica_to_their_caps() -> None:
    limiter = InflightLimiter(KeyFairness(max_inflight_per_key=2, per_key={"batch-worker": 3}), replica_cap=4)
    assert [limiter.acquire("a") for _ in range(3)] == [None, None, "key"]
    assert [limiter.acquire("batch-worker") for _ in range(3)] == [None, None, "replica"]
    assert limiter.in_flight() == 4 and limiter.in_flight("a") == 2
    limiter.release("a")
    assert limiter.acquire("b") is None and limiter.acquire("b") == "replica"
    for key in ("a", "b", "batch-worker", "batch-worker"):
        limiter.release(key)
    assert limiter.in_flight() == 0 and limiter.in_flight("a") == 0
    # A stray release never drives the count below zero (nor frees a slot it did not take).
    limiter.release("a")
    assert limiter.in_flight() == 0
    with pytest.raises(ValueError):
        InflightLimiter(KeyFairness(), replica_cap=0)


def test_fairness_settings_are_typed() -> None:
    for bad in ({"max_inflight_per_key": 0}, {"per_key": {"Bad Id": 2}}, {"per_key": {"a": 0}}, {"retry_after_s": 0}):
        with pytest.raises(ValidationError):
            KeyFairness.model_validate(bad)
    fairness = KeyFairness(max_inflight_per_key=3, per_key={"batch-worker": 9})
    assert (fairness.cap_for("x"), fairness.cap_for("batch-worker")) == (3, 9)


def test_the_replica_cap_is_the_guards_replicas_max_ongoing_requests() -> None:
    scaling = {"target_ongoing_requests": 4, "max_ongoing_requests": 12}
    model = {"model_id": "m", "source": "/m", "max_model_len": 64, "autoscaling": scaling}
    server = Catalog.model_validate({"models": [model], "layout": "vllm-server"})
    assert server.replica_inflight_cap() == 12
    ingress = Catalog.model_validate({"models": [model], "ingress": {"max_ongoing_requests": 90}})
    assert ingress.replica_inflight_cap() == 90


# ---------------------------------------------------------------- the middleware


class Engine:
    """A stand-in for vLLM's app: answers like it, and can hold a request open until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.hold = False
        self.started = 0
        self.stream_usage = False
        # The texts of a stream's steps after its role chunk.
        self.texts = ["a", "b", "c"]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.started += 1
        request = json.loads(body or b"{}")
        if self.hold:
            await self.release.wait()
        if request.get("stream"):
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i, text in enumerate(["", *self.texts]):
                delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
                chunk = {"id": "x", "model": MODEL, "choices": [{"index": 0, "delta": delta}]}
                await send(
                    {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
                )
            if self.stream_usage:
                # vLLM leaves the usage in the request state for middleware (RequestResponseMetadata).
                usage = type("Usage", (), {"prompt_tokens": 11, "completion_tokens": 3})()
                scope.setdefault("state", {})["request_metadata"] = type("M", (), {"final_usage_info": usage})()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"content": "hello"}}],
            "usage": {"prompt_tokens": 9, "total_tokens": 14, "completion_tokens": 5},
        }
        payload = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        # In two pieces, split inside the usage object: the reader must join them.
        cut = payload.index(b'"completion_tokens"')
        await send({"type": "http.response.body", "body": payload[:cut], "more_body": True})
        await send({"type": "http.response.body", "body": payload[cut:], "more_body": False})


class Harness:
    """The accounting around the real guard around the fake engine, with its log and counters captured."""

    def __init__(self, tmp_path: Path, *, per_key: int = 1, replica_cap: int = 2) -> None:
        path = tmp_path / "keys"
        path.write_text(f"team-a:{SECRET_A}\nteam-b:{SECRET_B}\n{SECRET_OLD}\n")
        self.keys = ApiKeys(str(path), "UNUSED", environ={})
        self.engine = Engine()
        self.registry = CollectorRegistry()
        # The server's own writer, on a file instead of its stderr.
        self.log_path = tmp_path / "access.log"
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        weakref.finalize(self, os.close, fd)
        log = AccessLog(fd)
        guard = ApiGuard(self.engine, keys=self.keys, limits=RequestLimits(max_tokens=64), model_ids=[MODEL])
        self.app = KeyAccounting(
            guard,
            keys=self.keys,
            fairness=KeyFairness(max_inflight_per_key=per_key, retry_after_s=3),
            replica_cap=replica_cap,
            model_ids=[MODEL],
            metrics=PrometheusKeyMetrics(self.registry),
            log=log,
        )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def call(
        self,
        key: str | None,
        body: dict[str, Any] | None = None,
        *,
        path: str = "/v1/chat/completions",
        disconnect: asyncio.Event | None = None,
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        raw = json.dumps(
            body if body is not None else {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        if key is not None:
            headers.append((b"authorization", f"Bearer {key}".encode()))
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if disconnect is not None:
                await disconnect.wait()
            else:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        out: dict[str, Any] = {"status": 0, "headers": {}, "body": b""}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
                out["headers"] = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
            else:
                out["body"] += message.get("body", b"")

        await self.app(scope, receive, send)
        return out["status"], out["headers"], out["body"]


def run(coro: typing.Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def test_a_key_over_its_cap_gets_429_with_retry_after_while_another_key_is_served(tmp_path: Path) -> None:
    h = Harness(tmp_path, per_key=1, replica_cap=3)

    async def scenario() -> tuple[Any, ...]:
        h.engine.hold = True
        first = asyncio.create_task(h.call(SECRET_A))
        while h.engine.started < 1:
            await asyncio.sleep(0)
        over = await h.call(SECRET_A)
        other = asyncio.create_task(h.call(SECRET_B))
        while h.engine.started < 2:
            await asyncio.sleep(0)
        assert h.app.limiter.in_flight() == 2
        h.engine.release.set()
        return over, await first, await other

    over, first, other = run(scenario())
    status, headers, body = over
    assert status == 429 and headers[b"retry-after"] == b"3"
    error = json.loads(body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests_in_flight"
    assert (
        "team-a" in error["message"]
        and SECRET_A not in error["message"]
        and set(error) == {"message", "type", "param", "code"}
    )
    assert first[0] == 200 and other[0] == 200
    assert h.engine.started == 2  # the refused request never reached the engine
    assert h.app.limiter.in_flight() == 0
    refused = [line for line in h.lines() if line["status"] == 429]
    assert len(refused) == 1 and refused[0]["refused"] == "key" and refused[0]["key_id"] == "team-a"
    assert h.metric("ray_llm_api_key_requests_total", key_id="team-a", model="", status="429") == 1


def test_the_replica_cap_refuses_every_key_once_full(tmp_path: Path) -> None:
    h = Harness(tmp_path, per_key=1, replica_cap=1)

    async def scenario() -> tuple[Any, Any]:
        h.engine.hold = True
        first = asyncio.create_task(h.call(SECRET_A))
        while h.engine.started < 1:
            await asyncio.sleep(0)
        busy = await h.call(SECRET_B)
        h.engine.release.set()
        return busy, await first

    (status, headers, body), first = run(scenario())
    assert status == 429 and headers[b"retry-after"] == b"3" and first[0] == 200
    assert json.loads(body)["error"]["code"] == "server_busy"
    assert [line["refused"] for line in h.lines() if line["status"] == 429] == ["replica"]


def test_a_stream_holds_its_slot_until_the_client_leaves(tmp_path: Path) -> None:
    h = Harness(tmp_path, per_key=1, replica_cap=4)

    async def scenario() -> int:
        h.engine.hold = True
        gone = asyncio.Event()
        stream = asyncio.create_task(
            h.call(
                SECRET_A,
                {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": PROMPT}]},
                disconnect=gone,
            )
        )
        while h.engine.started < 1:
            await asyncio.sleep(0)
        assert (await h.call(SECRET_A))[0] == 429  # held by the open stream
        # The client goes away: the app's call is cancelled (as Starlette's StreamingResponse does).
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        assert h.app.limiter.in_flight("team-a") == 0
        h.engine.hold = False
        return (await h.call(SECRET_A))[0]

    assert run(scenario()) == 200
    left = [line for line in h.lines() if line["status"] == 499]
    assert len(left) == 1 and left[0]["key_id"] == "team-a"


def test_the_log_line_names_the_key_and_counts_tokens_without_the_prompt_or_the_key(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    status, headers, _ = run(h.call(SECRET_A))
    assert status == 200
    (line,) = h.lines()
    assert line["key_id"] == "team-a" and line["model"] == MODEL and line["status"] == 200
    assert (line["prompt_tokens"], line["output_tokens"], line["tokens"]) == (9, 5, "exact")
    assert line["latency_ms"] >= 0 and line["first_byte_ms"] is not None and line["stream"] is False
    assert headers[b"x-request-id"].decode() == line["request_id"] and len(line["request_id"]) == 32
    text = h.log_path.read_text()
    for secret in (SECRET_A, SECRET_B, SECRET_OLD, PROMPT, "hello"):
        assert secret not in text
    assert h.metric("ray_llm_api_key_requests_total", key_id="team-a", model=MODEL, status="200") == 1
    assert h.metric("ray_llm_api_key_prompt_tokens_total", key_id="team-a", model=MODEL) == 9
    assert h.metric("ray_llm_api_key_generation_tokens_total", key_id="team-a", model=MODEL) == 5


def test_access_lines_reach_stderr_as_json_past_vllms_decorated_sys_stderr() -> None:
    """vLLM's API server puts "(APIServer pid=N) " before what passes sys.stderr; the access lines stay JSON."""
    code = """
import json, sys
from inference_server.fairness import AccessLog
write = sys.stderr.write
sys.stderr.write = lambda text: write("(APIServer pid=1) " + text)  # what vLLM's decorate_logs does
log = AccessLog()
sys.stderr.write("through sys.stderr\\n")
sys.stderr.flush()
for i in range(3):
    log.write(json.dumps({"request": i, "path": "/v1/" + "x" * 5000 * i}))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "workloads")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert lines[0] == "(APIServer pid=1) through sys.stderr"
    # Each line whole, the long ones too, and nothing before it.
    assert [json.loads(line)["request"] for line in lines[1:]] == [0, 1, 2]


def test_stream_tokens_come_from_vllms_request_state_else_are_counted(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    stream = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    h.engine.stream_usage = True
    assert run(h.call(SECRET_OLD, stream))[0] == 200
    h.engine.stream_usage = False
    assert run(h.call(SECRET_OLD, stream))[0] == 200
    exact, counted = h.lines()
    assert exact["key_id"] == fingerprint(SECRET_OLD) and exact["stream"] is True
    assert (exact["prompt_tokens"], exact["output_tokens"], exact["tokens"]) == (11, 3, "exact")
    # Three chunks with text; the role chunk is not a token.
    assert (counted["prompt_tokens"], counted["output_tokens"], counted["tokens"]) == (None, 3, "counted")
    key = fingerprint(SECRET_OLD)
    assert h.metric("ray_llm_api_key_prompt_tokens_total", key_id=key, model=MODEL) == 11  # never a guess
    assert h.metric("ray_llm_api_key_generation_tokens_total", key_id=key, model=MODEL) == 6


def test_the_routers_renders_are_logged_but_not_counted_as_the_keys_requests(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert run(h.call(SECRET_A, path="/v1/chat/completions/render"))[0] == 200
    assert run(h.call(SECRET_A))[0] == 200
    render, chat = h.lines()
    assert (render["key_id"], render["path"], chat["path"]) == (
        "team-a",
        "/v1/chat/completions/render",
        "/v1/chat/completions",
    )
    assert h.metric("ray_llm_api_key_requests_total", key_id="team-a", model=MODEL, status="200") == 1
    assert h.app.limiter.in_flight() == 0


def test_refusals_of_the_guard_are_logged_and_counted_too(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert run(h.call("not-a-key"))[0] == 401
    assert run(h.call(SECRET_B, {"model": MODEL, "messages": [], "max_tokens": 10**6}))[0] == 400
    unknown, bad = h.lines()
    assert (unknown["key_id"], unknown["status"], unknown["model"]) == (None, 401, None)
    assert (bad["key_id"], bad["status"]) == ("team-b", 400)
    assert "not-a-key" not in h.log_path.read_text()
    assert h.metric("ray_llm_api_key_requests_total", key_id="", model="", status="401") == 1
    assert h.metric("ray_llm_api_key_requests_total", key_id="team-b", model="", status="400") == 1
    assert h.app.limiter.in_flight() == 0


def test_a_sane_client_request_id_is_kept_and_health_is_not_logged(tmp_path: Path) -> None:
    h = Harness(tmp_path)

    async def scenario() -> None:
        scope = {"type": "http", "method": "GET", "path": "/health", "headers": [], "query_string": b""}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            return None

        await h.app(scope, receive, send)

    run(scenario())
    assert h.lines() == []


def test_the_answer_reader_finds_model_and_usage_across_chunks() -> None:
    reader = AnswerReader()
    body = json.dumps({"id": "c", "model": MODEL, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    raw = body.encode()
    for i in range(0, len(raw), 7):
        reader.feed(raw[i : i + 7], stream=False)
    assert reader.model == MODEL and reader.usage == {"prompt_tokens": 4, "completion_tokens": 2}
    # A "usage" inside the text is escaped and never read as the usage.
    quoted = AnswerReader()
    quoted.feed(json.dumps({"model": MODEL, "choices": [{"text": '"usage":{"prompt_tokens":99}'}]}).encode(), False)
    assert quoted.usage is None


def _vllm_completion_stream(texts: list[str], usage: dict[str, int]) -> list[bytes]:
    """A streamed /v1/completions answer as vLLM's own serving code writes it: one event per message."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")

    def chunk(i: int, text: str) -> bytes:
        finish = "length" if i == len(texts) - 1 else None
        choice = protocol.CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish)
        response = protocol.CompletionStreamResponse(id="cmpl-1", created=1, model=MODEL, choices=[choice])
        return f"data: {response.model_dump_json(exclude_unset=True)}\n\n".encode()

    final = protocol.CompletionStreamResponse(
        id="cmpl-1", created=1, model=MODEL, choices=[], usage=protocol.UsageInfo(**usage)
    ).model_dump_json(exclude_unset=False, exclude_none=True)
    return [*(chunk(i, t) for i, t in enumerate(texts)), f"data: {final}\n\n".encode(), b"data: [DONE]\n\n"]


@pytest.mark.parametrize("split", ["as sent", "every 5 bytes", "one piece", "events in pairs"])
def test_the_readers_count_of_a_vllm_stream_does_not_depend_on_how_it_was_cut(split: str) -> None:
    """Whole events take the reader's short path and cut ones the carried one: both must count alike."""
    # An empty text (vLLM's chunk for a step that decoded no character) is not counted;
    # a text that quotes the marks the reader looks for is one token, not a usage object.
    texts = ["Hello", " world", "", ' "index": 3, "usage": {"prompt_tokens": 99}', "!"]
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    events = _vllm_completion_stream(texts, usage)
    whole = b"".join(events)
    pieces = {
        "as sent": events,
        "every 5 bytes": [whole[i : i + 5] for i in range(0, len(whole), 5)],
        "one piece": [whole],
        "events in pairs": [b"".join(events[i : i + 2]) for i in range(0, len(events), 2)],
    }[split]
    reader = AnswerReader()
    for piece in pieces:
        reader.feed(piece, stream=True)
    assert (reader.model, reader.choice_events, reader.usage) == (MODEL, 4, usage)


def _long_stream() -> tuple[list[bytes], dict[str, int], int]:
    """A vLLM stream of more than three holds' bytes, some of its steps without text."""
    texts = [f" t{i}" if i % 7 else "" for i in range(3 * STREAM_HOLD_BYTES // 100)]
    usage = {"prompt_tokens": 3, "completion_tokens": len(texts), "total_tokens": 3 + len(texts)}
    events = _vllm_completion_stream(texts, usage)
    assert sum(map(len, events)) > 3 * STREAM_HOLD_BYTES
    return events, usage, sum(1 for t in texts if t)


def test_a_long_stream_is_counted_alike_however_its_batches_fall() -> None:
    """Events cut across batch boundaries, and counts read mid-stream, give the count of the whole."""
    events, usage, expected = _long_stream()
    whole = b"".join(events)
    for size in (13, 200, 5000, len(whole)):
        reader = AnswerReader()
        seen = []
        for i in range(0, len(whole), size):
            reader.feed(whole[i : i + size], stream=True)
            seen.append(reader.choice_events)
        # Never more than the events the bytes so far hold whole, and never going back.
        assert seen == sorted(seen) and seen[-1] == expected, size
        assert (reader.model, reader.usage) == (MODEL, usage)
    # Read before the stream's end: the events whole so far, not the one cut in two.
    reader = AnswerReader()
    reader.feed(events[1] + events[2][:20], stream=True)
    assert reader.choice_events == 1
    reader.feed(events[2][20:], stream=True)
    assert reader.choice_events == 2


def test_a_stream_nobody_reads_holds_at_most_its_bound() -> None:
    """Held chunks are read once they pass the bound, not kept to the stream's end, and count the same."""
    events, usage, expected = _long_stream()
    reader = AnswerReader()
    most = 0
    for event in events:
        reader.feed(event, stream=True)
        most = max(most, sum(map(len, reader._pending)))
    assert most < STREAM_HOLD_BYTES
    assert (reader.choice_events, reader.usage) == (expected, usage)


def test_a_stream_vllm_finished_is_never_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's usage in the request state, the held chunks are dropped unread: no per-token parsing.

    A stream the client left (no usage in the state) is still read, and counted.
    """
    reads: list[int] = []
    read = AnswerReader._read_events

    def counted_read(self: AnswerReader) -> None:
        reads.append(len(self._pending))
        read(self)

    monkeypatch.setattr(AnswerReader, "_read_events", counted_read)
    h = Harness(tmp_path)
    # Two hundred tokens: far below the bound in bytes, past any batch of a few dozen events.
    h.engine.texts = [f" t{i}" for i in range(200)]
    stream = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    h.engine.stream_usage = True
    assert run(h.call(SECRET_OLD, stream))[0] == 200
    assert [n for n in reads if n] == []
    h.engine.stream_usage = False
    assert run(h.call(SECRET_OLD, stream))[0] == 200
    # Read once, at the end: the role chunk, 200 tokens and [DONE].
    assert [n for n in reads if n] == [202]
    exact, counted = h.lines()
    # The exact figures are the stand-in's state (3 tokens); the counted ones, its 200 events.
    assert (exact["output_tokens"], exact["tokens"], counted["output_tokens"], counted["tokens"]) == (
        3,
        "exact",
        200,
        "counted",
    )


def test_an_event_that_never_ends_is_kept_only_to_its_bound() -> None:
    """A stream that sends no blank line can not make the reader hold all of it."""
    reader = AnswerReader()
    piece = b"data: {" + b"x" * 65536
    for _ in range(MAX_EVENT_BYTES // len(piece) * 3):
        reader.feed(piece, stream=True)
    assert reader.choice_events == 0
    assert len(reader._tail) <= MAX_EVENT_BYTES
    # Its start is kept, where a choice's marks are: once it ends, it counts.
    reader = AnswerReader()
    reader.feed(b'data: {"choices":[{"index":0,"text":"a' + b"b" * (2 * MAX_EVENT_BYTES), stream=True)
    assert reader.choice_events == 0  # read now: the unfinished event is cut to its bound
    reader.feed(b'"}]}\n\n', stream=True)
    assert reader.choice_events == 1


# ---------------------------------------------------------------- config and capacity rules


def _problems(change: Callable[[dict[str, Any]], None], stack: str = "prod") -> list[str]:
    raw = stack_sections(stack)
    change(raw)
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return [str(p) for p in info.value.problems]


def test_a_key_cap_must_stay_below_every_replica_cap() -> None:
    def too_big(raw: dict[str, Any]) -> None:
        raw.setdefault("serving", {})["fairness"] = {"max_inflight_per_key": 48}

    (problem,) = [p for p in _problems(too_big) if "fairness" in p]
    assert problem.startswith("config error: serving.fairness.max_inflight_per_key: 48 is not below models[")
    assert "autoscaling.max_ongoing_requests (48)" in problem


def test_the_batch_workers_key_covers_its_own_concurrency() -> None:
    cfg = stack_config("prod")
    assert cfg.batch.enabled
    assert key_fairness(cfg).cap_for(BATCH_WORKER_KEY_ID) == cfg.batch.messages_per_worker

    def too_small(raw: dict[str, Any]) -> None:
        raw.setdefault("serving", {})["fairness"] = {"per_key": {BATCH_WORKER_KEY_ID: 2}}

    assert [p for p in _problems(too_small) if "per_key" in p] == [
        f"config error: serving.fairness.per_key.{BATCH_WORKER_KEY_ID}: 2 is below batch.messages_per_worker "
        f"({cfg.batch.messages_per_worker}): each batch worker would be refused part of its own concurrency at the "
        "replica it talks to"
    ]


def test_the_config_secret_names_each_key_once_and_never_shows_one() -> None:
    assert _check_api_keys(f"team-a:{SECRET_A},{SECRET_OLD}") == []
    problems = [
        str(p)
        for p in _check_api_keys(
            f"team-a:{SECRET_A}, team-a:{SECRET_B}, batch-worker:{SECRET_B}x, key-1:{SECRET_A}z, "
            f"x:short, Bad:{SECRET_A}"
        )
    ]
    assert problems == [
        "config error: api_keys: key 2 ('team-a') uses the id of another key",
        "config error: api_keys: key 3 ('batch-worker') uses the id 'batch-worker', the batch worker's own",
        "config error: api_keys: key 4 ('key-1') uses an id starting 'key-', kept for keys written without an id",
        "config error: api_keys: key 5 ('x') is shorter than 24 characters",
        "config error: api_keys: key 6: the key id before ':' must be 1-32 lowercase letters, digits and '-', "
        "starting and ending with a letter or digit",
    ]
    assert not [p for p in problems if SECRET_A in p or SECRET_B in p]


def test_the_capacity_plan_refuses_a_replica_cap_its_kv_cache_can_not_hold() -> None:
    cfg = stack_config("dev")
    model = cfg.models[0]
    geometry = resolve_geometry(model.geometry, model.source, model.model_id)
    assert geometry is not None
    plan = plan_replica(
        geometry,
        model.parameters_billion,
        EngineSettings.of(model),
        Device.of(cfg.node_groups.gpu_group(model.gpu_group).instance()),
    )
    fits = MAX_INFLIGHT_KV_ROUNDS * plan.kv_tokens // plan.planning_context_tokens
    at = model.model_copy(update={"autoscaling": model.autoscaling.model_copy(update={"max_ongoing_requests": fits})})
    assert list(inflight_problems("m", at, plan)) == []
    over = model.model_copy(
        update={"autoscaling": model.autoscaling.model_copy(update={"max_ongoing_requests": fits + 1})}
    )
    ((key, message),) = inflight_problems("m", over, plan)
    assert key == "autoscaling.max_ongoing_requests"
    assert f"{fits + 1} requests in flight" in message and f"set at most {fits}" in message

    def raise_cap(raw: dict[str, Any]) -> None:
        raw["models"][0]["autoscaling"]["max_ongoing_requests"] = fits + 1

    assert [p for p in _problems(raise_cap, "dev") if "in flight" in p] == [
        f"config error: models[0].autoscaling.max_ongoing_requests: {message.replace(repr('m'), repr(model.name))}"
    ]
