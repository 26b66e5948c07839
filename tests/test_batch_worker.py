"""The batch worker against a fake SQS, a fake S3 and httpx.MockTransport: what it settles and how it stops.

tests/e2e/test_batch_e2e.py runs the same worker against moto's SQS and S3 and the real server.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from workloads.inference_server.batch_settings import WorkerSettings, env_names
from workloads.inference_server.batch_worker import (
    ApiKeyFile,
    BatchWorker,
    KeySource,
    Outcome,
    install_signal_handlers,
    readable_request_id,
    retry_delay,
)

API_KEY = "sk-batch-test-key-0123456789abcdef"
MODEL = "llama-3.1-8b-instruct"
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"message": {"content": "hi"}}]}


def settings(**changes: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/llm-prod-batch",
        "region": "us-east-1",
        "results_bucket": "results-bucket",
        "model": MODEL,
        "base_url": "http://llama-31-8b-serve-svc.llm.svc:8000/v1",
        "api_keys_file": "/etc/inference/api-keys/keys",
        "concurrency": 2,
        "request_timeout_seconds": 5,
        "retry_delay_seconds": 30,
        "wait_seconds": 0,
    }
    return WorkerSettings(**{**base, **changes})


class FakeSqs:
    """Hands out queued messages and records what the worker did with each receipt."""

    def __init__(self, messages: list[dict[str, Any]] | None = None) -> None:
        self.pending = list(messages or [])
        self.deleted: list[str] = []
        self.visibility: dict[str, int] = {}
        self.receives: list[int] = []
        self.lock = threading.Lock()
        self.on_receive: Callable[[], None] | None = None

    def receive_message(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs["MessageSystemAttributeNames"] == ["ApproximateReceiveCount"]
        with self.lock:
            self.receives.append(kwargs["MaxNumberOfMessages"])
            taken, self.pending = (
                self.pending[: kwargs["MaxNumberOfMessages"]],
                self.pending[kwargs["MaxNumberOfMessages"] :],
            )
        if self.on_receive is not None:
            self.on_receive()
        if not taken:
            time.sleep(0.01)
        return {"Messages": taken}

    def delete_message(self, **kwargs: Any) -> None:
        with self.lock:
            self.deleted.append(kwargs["ReceiptHandle"])

    def change_message_visibility(self, **kwargs: Any) -> None:
        with self.lock:
            self.visibility[kwargs["ReceiptHandle"]] = kwargs["VisibilityTimeout"]


class FakeS3:
    def __init__(self, fail: bool = False) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail = fail

    def put_object(self, **kwargs: Any) -> None:
        if self.fail:
            raise RuntimeError("AccessDenied")
        assert kwargs["ContentType"] == "application/json"
        self.objects[(kwargs["Bucket"], kwargs["Key"])] = json.loads(kwargs["Body"])


def message(n: int, body: Any = None, receives: int = 1, raw: str | None = None) -> dict[str, Any]:
    doc = {"id": f"req-{n}", "body": body if body is not None else {"messages": [{"role": "user", "content": "x"}]}}
    return {
        "MessageId": f"m-{n}",
        "ReceiptHandle": f"r-{n}",
        "Body": raw if raw is not None else json.dumps(doc),
        "Attributes": {"ApproximateReceiveCount": str(receives)},
    }


Handler = Callable[[httpx.Request], httpx.Response]


class FixedKey:
    """One key that never changes; records what the worker said about it."""

    def __init__(self, key: str = API_KEY) -> None:
        self.value = key
        self.refusals: list[str] = []

    def key(self) -> str:
        return self.value

    def refused(self, key: str) -> None:
        self.refusals.append(key)


def worker(
    handler: Handler,
    sqs: FakeSqs | None = None,
    s3: FakeS3 | None = None,
    keys: KeySource | None = None,
    **changes: Any,
) -> BatchWorker:
    s = settings(**changes)
    http = httpx.Client(base_url=s.base_url, transport=httpx.MockTransport(handler))
    return BatchWorker(
        s, sqs=sqs or FakeSqs(), s3=s3 or FakeS3(), http=http, keys=keys or FixedKey(), now=lambda: 1_700_000_000.0
    )


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=ANSWER)


def test_success_posts_with_the_key_writes_the_answer_then_deletes() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANSWER)

    sqs, s3 = FakeSqs(), FakeS3()
    assert worker(handler, sqs, s3).handle(message(1)) is Outcome.SUCCEEDED
    (request,) = seen
    assert str(request.url) == "http://llama-31-8b-serve-svc.llm.svc:8000/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    # The worker fills in its model when the request leaves it out.
    assert json.loads(request.content)["model"] == MODEL
    result = s3.objects[("results-bucket", "results/req-1.json")]
    assert (result["status"], result["status_code"], result["response"]) == ("succeeded", 200, ANSWER)
    assert sqs.deleted == ["r-1"] and sqs.visibility == {}


@pytest.mark.parametrize("code", [500, 502, 503, 429, 408])
def test_server_errors_and_rate_limits_stay_on_the_queue_with_a_growing_backoff(code: int) -> None:
    sqs, s3 = FakeSqs(), FakeS3()
    w = worker(lambda r: httpx.Response(code, json={"error": {"message": "busy"}}), sqs, s3)
    assert w.handle(message(1, receives=3)) is Outcome.RETRY
    assert sqs.deleted == [] and s3.objects == {}
    assert sqs.visibility == {"r-1": 30 * 2**2}


def test_timeouts_and_connection_errors_stay_on_the_queue() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    for handler in (timeout, refused):
        sqs, s3 = FakeSqs(), FakeS3()
        assert worker(handler, sqs, s3).handle(message(1)) is Outcome.RETRY
        assert sqs.deleted == [] and s3.objects == {} and sqs.visibility == {"r-1": 30}


def test_a_client_error_is_recorded_as_the_result_and_deleted() -> None:
    error = {"message": "max_tokens is too large", "type": "invalid_request_error", "param": None, "code": None}
    sqs, s3 = FakeSqs(), FakeS3()
    w = worker(lambda r: httpx.Response(400, json={"error": error}), sqs, s3)
    assert w.handle(message(1, receives=2)) is Outcome.FAILED
    result = s3.objects[("results-bucket", "results/req-1.json")]
    assert (result["status"], result["status_code"], result["error"], result["attempts"]) == ("failed", 400, error, 2)
    assert sqs.deleted == ["r-1"]


@pytest.mark.parametrize(
    ("msg", "key", "error_type"),
    [
        (message(1, raw=json.dumps({"id": "req-1", "body": "not an object"})), "results/req-1.json", "invalid_request"),
        (message(1, raw=json.dumps({"id": "req-1", "extra": 1, "body": {}})), "results/req-1.json", "invalid_request"),
        (message(1, body={"messages": [], "stream": True}), "results/req-1.json", "invalid_request"),
        (message(1, body={"messages": [], "model": "other"}), "results/req-1.json", "model_not_found"),
    ],
)
def test_requests_that_can_never_succeed_are_answered_with_an_error_without_a_call(
    msg: dict[str, Any], key: str, error_type: str
) -> None:
    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request should be sent")

    sqs, s3 = FakeSqs(), FakeS3()
    assert worker(never, sqs, s3).handle(msg) is Outcome.FAILED
    assert s3.objects[("results-bucket", key)]["error"]["type"] == error_type
    assert sqs.deleted == ["r-1"]


@pytest.mark.parametrize(
    "raw",
    ["not json", json.dumps({"id": "../etc", "body": {}}), json.dumps({"body": {}}), json.dumps([1]), ""],
    ids=["not-json", "bad-id", "no-id", "array", "empty"],
)
def test_a_message_without_a_readable_id_is_left_for_the_dead_letter_queue(raw: str) -> None:
    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request should be sent")

    sqs, s3 = FakeSqs(), FakeS3()
    # No back-off, however often it came back: redrive moves it on after maxReceiveCount receives.
    assert worker(never, sqs, s3, retry_delay_seconds=7).handle(message(1, raw=raw, receives=4)) is Outcome.REJECTED
    assert sqs.deleted == [] and s3.objects == {}
    assert sqs.visibility == {"r-1": 7}


def test_readable_request_id() -> None:
    assert readable_request_id(json.dumps({"id": "abc-1", "body": 3})) == "abc-1"
    for raw in ("{", "[]", json.dumps({"id": "a/b"}), json.dumps({"id": "abc\n"}), json.dumps({"id": 5})):
        assert readable_request_id(raw) is None, raw


def test_a_401_keeps_the_message_and_marks_the_key_refused() -> None:
    sqs, s3, keys = FakeSqs(), FakeS3(), FixedKey()
    w = worker(lambda r: httpx.Response(401, json={"error": {"code": "invalid_api_key"}}), sqs, s3, keys)
    assert w.handle(message(1, receives=2)) is Outcome.RETRY
    assert sqs.deleted == [] and s3.objects == {}
    assert sqs.visibility == {"r-1": 60}
    assert keys.refusals == [API_KEY]


def test_a_result_that_can_not_be_stored_keeps_the_message() -> None:
    sqs = FakeSqs()
    assert worker(ok, sqs, FakeS3(fail=True)).handle(message(1)) is Outcome.RETRY
    assert sqs.deleted == []


def test_retry_delay_doubles_and_stops_at_the_sqs_limit() -> None:
    s = settings(retry_delay_seconds=30)
    assert [retry_delay(s, n) for n in (1, 2, 3)] == [30, 60, 120]
    assert retry_delay(s, 20) == 43200


def test_concurrency_is_bounded_and_every_message_is_answered() -> None:
    in_flight, peak, lock = 0, 0, threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.02)
        with lock:
            in_flight -= 1
        return httpx.Response(200, json=ANSWER)

    sqs = FakeSqs([message(n) for n in range(12)])
    stop = threading.Event()
    w = worker(handler, sqs, concurrency=3)
    thread = threading.Thread(target=w.run, args=(stop,))
    thread.start()
    deadline = time.time() + 10
    while len(sqs.deleted) < 12 and time.time() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=10)
    assert sorted(sqs.deleted) == sorted(f"r-{n}" for n in range(12))
    assert peak <= 3 and max(sqs.receives) <= 3


def test_stop_drains_in_flight_requests_and_receives_no_more() -> None:
    started, release = threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        started.set()
        release.wait(5)
        return httpx.Response(200, json=ANSWER)

    sqs = FakeSqs([message(1)])
    stop = threading.Event()
    w = worker(slow, sqs, concurrency=1)
    thread = threading.Thread(target=w.run, args=(stop,))
    thread.start()
    assert started.wait(5)
    stop.set()
    time.sleep(0.1)
    receives = len(sqs.receives)
    assert thread.is_alive()  # waiting for the request in flight
    release.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert sqs.deleted == ["r-1"]
    assert len(sqs.receives) == receives


def test_messages_received_while_stopping_are_handed_back() -> None:
    stop = threading.Event()
    sqs = FakeSqs([message(1), message(2)])
    sqs.on_receive = stop.set  # SIGTERM arrives during the long poll

    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request after stop")

    worker(never, sqs, concurrency=2).run(stop)
    assert sqs.visibility == {"r-1": 0, "r-2": 0}
    assert sqs.deleted == []


def test_sigterm_sets_the_stop_event() -> None:
    stop = threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        install_signal_handlers(stop)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_logs_never_carry_the_api_key_or_the_prompt(caplog: pytest.LogCaptureFixture) -> None:
    secret_prompt = "my card number is 4111"
    caplog.set_level(logging.DEBUG)
    w = worker(lambda r: httpx.Response(400, json={"error": {"message": "bad"}}), FakeSqs(), FakeS3())
    w.handle(message(1, body={"messages": [{"role": "user", "content": secret_prompt}]}))
    w2 = worker(ok, FakeSqs(), FakeS3())
    w2.handle(message(2))
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', {})}" for r in caplog.records)
    assert "request_failed" in text and "request_succeeded" in text
    assert API_KEY not in text and secret_prompt not in text


def test_settings_read_from_the_environment_names_infra_writes() -> None:
    env = {
        env_names()[k]: str(v)
        for k, v in settings().model_dump().items()
        if k not in ("results_prefix", "retry_delay_seconds", "wait_seconds")
    }
    parsed = WorkerSettings.from_env({**env, "HOME": "/home/ray"})
    assert parsed.queue_url.endswith("/llm-prod-batch") and parsed.concurrency == 2
    with pytest.raises(ValueError, match="INFERENCE_BASE_URL"):
        WorkerSettings.from_env({**env, "INFERENCE_BASE_URL": "http://svc:8000"})


# ---------------------------------------------------------------- the key file and rotation


def write(path: Path, text: str) -> None:
    """Replace the file the way a Secret volume does: a new file swapped in."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_key_file_skips_comments_and_refuses_an_empty_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2026-01\n\n  first  \nsecond\n")
    assert ApiKeyFile(str(keys_file)).key() == "first"
    keys_file.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no API key"):
        ApiKeyFile(str(keys_file))


def test_the_key_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    write(keys_file, "old\n")
    keys = ApiKeyFile(str(keys_file))
    assert keys.key() == "old"
    write(keys_file, "new\n")
    assert keys.key() == "new"
    # Briefly absent (mid-swap): the last keys stay.
    keys_file.unlink()
    assert keys.key() == "new"
    write(keys_file, "newer\n")
    assert keys.key() == "newer"


def test_a_refused_key_makes_way_for_the_next_one(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    write(keys_file, "new\nold\n")
    keys = ApiKeyFile(str(keys_file))
    assert keys.key() == "new"
    keys.refused("new")
    assert keys.key() == "old"
    keys.refused("old")
    assert keys.key() == "new"  # every key refused: all are tried again
    keys.refused("new")
    write(keys_file, "newer\nold\n")
    assert keys.key() == "newer"  # a changed file starts afresh


def server_accepting(accepted: set[str], seen: list[str]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        key = request.headers["authorization"].removeprefix("Bearer ")
        seen.append(key)
        if key not in accepted:
            return httpx.Response(401, json={"error": {"message": "bad key", "code": "invalid_api_key"}})
        return httpx.Response(200, json=ANSWER)

    return handler


def test_rotation_when_the_worker_sees_the_new_key_first(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    write(keys_file, "old\n")
    keys = ApiKeyFile(str(keys_file))
    accepted, seen = {"old"}, []
    sqs, s3 = FakeSqs(), FakeS3()
    w = worker(server_accepting(accepted, seen), sqs, s3, keys)
    assert w.handle(message(1)) is Outcome.SUCCEEDED
    write(keys_file, "new\n")  # the worker's copy of the Secret changed; the server's has not yet
    assert w.handle(message(2)) is Outcome.RETRY
    assert "r-2" not in sqs.deleted and ("results-bucket", "results/req-2.json") not in s3.objects
    accepted.add("new")  # the server reloads its copy
    assert w.handle(message(2, receives=2)) is Outcome.SUCCEEDED
    assert seen == ["old", "new", "new"]
    assert s3.objects[("results-bucket", "results/req-2.json")]["attempts"] == 2
    assert sqs.deleted == ["r-1", "r-2"]


def test_rotation_falls_back_to_the_old_key_still_in_the_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    write(keys_file, "new\nold\n")
    accepted, seen = {"old"}, []
    w = worker(server_accepting(accepted, seen), keys=ApiKeyFile(str(keys_file)))
    assert w.handle(message(1)) is Outcome.RETRY
    assert w.handle(message(1, receives=2)) is Outcome.SUCCEEDED
    assert seen == ["new", "old"]
