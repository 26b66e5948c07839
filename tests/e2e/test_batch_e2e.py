"""End-to-end: the batch worker against moto's SQS and S3 (AWS's wire protocol) and the real server.

Real parts only: the worker is ``python -m inference_server.batch_worker``
with the environment the Deployment gives it, boto3 unchanged (it finds moto
through ``AWS_ENDPOINT_URL``), the queue's dead-letter redrive is SQS's own
(as moto implements it), and the answers come from the real inference server
of the session fixture, through its guard. Covered: one results object per
message, a key rotation with a 401 in the middle (the message survives and
succeeds once the server has the new key), and a poison message that SQS
moves to the dead-letter queue after maxReceiveCount receives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from localserve import moto_server
from localserve.processes import Child, child_env
from localserve.server import LIMIT_MAX_TOKENS

from .conftest import ServerInfo

pytestmark = pytest.mark.e2e

BUCKET = "batch-results"
PREFIX = "results/"
# Enough receives for a rotation (the server re-reads its key file at most every
# 10 s; retries come 1, 2, 4, 8 s apart), few enough for a quick dead-letter.
MAX_RECEIVE_COUNT = 6
RETRY_DELAY_S = 1
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, log: Child | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = f"\nworker log:\n{log.log_tail(40)}" if log is not None else ""
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
        time.sleep(0.25)


@dataclass
class Batch:
    moto: moto_server.MotoServer
    sqs: Any
    s3: Any
    queue_url: str
    dlq_url: str
    worker: Child
    worker_keys: Path
    server_keys: Path
    server: ServerInfo

    def send(self, request_id: str, body: dict[str, Any] | None = None, raw: str | None = None) -> None:
        doc = {"id": request_id, "body": body if body is not None else self.chat()}
        self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=raw if raw is not None else json.dumps(doc))

    @staticmethod
    def chat(**fields: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, **fields}

    def result(self, request_id: str) -> dict[str, Any] | None:
        try:
            obj = self.s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}{request_id}.json")
        except self.s3.exceptions.NoSuchKey:
            return None
        return dict(json.loads(obj["Body"].read()))

    def result_keys(self) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def events(self, event: str, **match: Any) -> list[dict[str, Any]]:
        found = []
        for line in self.worker.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            doc = json.loads(line)
            if doc.get("event") == event and all(doc.get(k) == v for k, v in match.items()):
                found.append(doc)
        return found

    def queue_depth(self, url: str) -> int:
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        attributes = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        return sum(int(attributes[n]) for n in names)


def write_atomically(path: Path, text: str) -> None:
    """Replace a key file as a Secret volume update does: a whole new file swapped in."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def batch(server: ServerInfo, e2e_dir: Path) -> Iterator[Batch]:
    work = e2e_dir / f"batch-{server.layout}"
    work.mkdir(exist_ok=True)
    server_keys = e2e_dir / server.layout / "keys"
    assert server.api_key in server_keys.read_text(), "the server fixture's key file moved"
    original_keys = server_keys.read_text()
    moto = moto_server.start(work)
    worker: Child | None = None
    try:
        sqs, s3 = moto.client("sqs"), moto.client("s3")
        dlq_url = sqs.create_queue(QueueName="llm-batch-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        redrive = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": MAX_RECEIVE_COUNT}
        queue_url = sqs.create_queue(
            QueueName="llm-batch",
            Attributes={"RedrivePolicy": json.dumps(redrive), "VisibilityTimeout": "120"},
        )["QueueUrl"]
        s3.create_bucket(Bucket=BUCKET)
        worker_keys = work / "worker-keys"
        write_atomically(worker_keys, f"# the worker's copy of the API-key Secret\n{server.api_key}\n")
        env = child_env(
            {
                **moto.env(),
                "BATCH_QUEUE_URL": queue_url,
                "BATCH_RESULTS_BUCKET": BUCKET,
                "BATCH_RESULTS_PREFIX": PREFIX,
                "BATCH_MODEL": server.model_id,
                "INFERENCE_BASE_URL": server.base_url,
                "INFERENCE_API_KEYS_FILE": str(worker_keys),
                "BATCH_CONCURRENCY": "2",
                "BATCH_REQUEST_TIMEOUT_SECONDS": "60",
                "BATCH_RETRY_DELAY_SECONDS": str(RETRY_DELAY_S),
                "BATCH_WAIT_SECONDS": "1",
            }
        )
        worker = Child.start(
            "batch-worker", [sys.executable, "-m", "inference_server.batch_worker"], env, work / "worker.log"
        )
        yield Batch(moto, sqs, s3, queue_url, dlq_url, worker, worker_keys, server_keys, server)
    finally:
        write_atomically(server_keys, original_keys)
        if worker is not None:
            worker.stop(grace_s=15)
        moto.stop()


def test_every_message_gets_one_result_object(batch: Batch) -> None:
    good = [f"good-{n}" for n in range(3)]
    for request_id in good:
        batch.send(request_id)
    # Client mistakes are answered too: the server's 4xx becomes the result, and the message is done.
    batch.send("too-long", batch.chat(max_tokens=LIMIT_MAX_TOKENS + 1))
    batch.send("string-max-tokens", batch.chat(max_tokens="100000"))
    batch.send("too-many-choices", batch.chat(n=64))
    expected = {f"{PREFIX}{i}.json" for i in [*good, "too-long", "string-max-tokens", "too-many-choices"]}
    wait_for("a result for every message", lambda: expected <= set(batch.result_keys()), 120, batch.worker)

    for request_id in good:
        result = batch.result(request_id)
        assert result is not None
        assert (result["status"], result["status_code"], result["attempts"]) == ("succeeded", 200, 1), result
        assert result["response"]["choices"][0]["message"]["content"] is not None
        assert result["model"] == batch.server.model_id
    for request_id, param, code in (
        ("too-long", "max_tokens", "max_tokens_exceeded"),
        ("string-max-tokens", "max_tokens", "invalid_type"),
        ("too-many-choices", "n", "too_many_choices"),
    ):
        result = batch.result(request_id)
        assert result is not None and (result["status"], result["status_code"]) == ("failed", 400), result
        assert (result["error"]["param"], result["error"]["code"]) == (param, code)
        assert set(result["error"]) == {"message", "type", "param", "code"}
    # One object per message, and every message is off the queue.
    assert [k for k in batch.result_keys() if k in expected] == sorted(expected)
    wait_for("an empty queue", lambda: batch.queue_depth(batch.queue_url) == 0 or None, 30, batch.worker)
    assert batch.queue_depth(batch.dlq_url) == 0


def test_key_rotation_with_a_401_in_between(batch: Batch) -> None:
    new_key = "rotated-" + os.urandom(12).hex()
    # The worker's copy of the Secret changes first: it now holds only a key the server does not know yet.
    write_atomically(batch.worker_keys, f"{new_key}\n")
    batch.send("rotation-1")
    refused = wait_for(
        "a 401 for the request sent with the new key",
        lambda: batch.events("request_retry", request_id="rotation-1", reason="http_401"),
        60,
        batch.worker,
    )
    assert refused[0]["status_code"] == 401
    # The 401 neither deleted the message nor wrote a result.
    assert batch.result("rotation-1") is None
    assert batch.queue_depth(batch.queue_url) >= 1

    # The server's copy of the Secret catches up (both keys valid during the rotation).
    write_atomically(batch.server_keys, batch.server_keys.read_text() + f"{new_key}\n")
    result = wait_for("the rotated request's result", lambda: batch.result("rotation-1"), 90, batch.worker)
    assert (result["status"], result["status_code"]) == ("succeeded", 200), result
    assert result["attempts"] >= 2
    assert not batch.events("request_failed", request_id="rotation-1")
    assert batch.queue_depth(batch.dlq_url) == 0

    # Rotating back: the worker picks the changed file up for the very next request.
    write_atomically(batch.worker_keys, f"{batch.server.api_key}\n")
    batch.send("rotation-2")
    result = wait_for("the result after rotating back", lambda: batch.result("rotation-2"), 60, batch.worker)
    assert (result["status"], result["attempts"]) == ("succeeded", 1), result


def test_a_poison_message_lands_in_the_dead_letter_queue(batch: Batch) -> None:
    poison = "{this is not a batch request"
    batch.send("unused", raw=poison)

    def dead_letter() -> list[dict[str, Any]] | None:
        messages = batch.sqs.receive_message(
            QueueUrl=batch.dlq_url,
            MaxNumberOfMessages=1,
            WaitTimeSeconds=1,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        ).get("Messages", [])
        return messages or None

    (landed,) = wait_for("the poison message in the dead-letter queue", dead_letter, 90, batch.worker)
    assert landed["Body"] == poison
    # The worker never deleted it: it came back every time until SQS's redrive took it away.
    rejected = batch.events("message_rejected", reason="unreadable_message")
    assert len(rejected) == MAX_RECEIVE_COUNT, rejected
    assert [e["receives"] for e in rejected] == list(range(1, MAX_RECEIVE_COUNT + 1))
    assert batch.queue_depth(batch.queue_url) == 0
    # No result object stands in for a message whose id could not be read.
    assert all("unused" not in key for key in batch.result_keys())
