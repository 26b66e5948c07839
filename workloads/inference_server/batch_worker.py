"""The batch worker: answers OpenAI chat requests queued in SQS and writes each answer to S3.

Run as ``python -m inference_server.batch_worker`` (or ``inference-batch-worker``)
with the settings of :class:`~inference_server.batch_settings.WorkerSettings` in
the environment. Needs pydantic, httpx and boto3 only (no Ray, no vLLM).

Delivery is at least once, and a message is deleted only once its result is
stored (one object per message, ``s3://<bucket>/<prefix><id>.json``; a
redelivery overwrites it with the same answer):

- a 2xx answer is written as the result, then the message is deleted;
- a request that can never succeed (a 4xx answer other than 401/408/409/425/429,
  ``stream``, another model, a body that is not a request but whose ``id`` can
  be read) is answered: the error is written as the result and the message is
  deleted;
- a 401 means the key is being rotated: the key is marked refused, the key
  file is read again before the next request (the next key in it is tried),
  and the message stays on the queue;
- a 5xx answer, 408/409/425/429, a timeout, a connection error or a failed
  result write leave the message on the queue, hidden for a back-off that
  doubles with each receive;
- a message without a readable ``id`` (not JSON, no id) has nowhere to put a
  result: it is handed back after ``retry_delay_seconds`` every time.

The worker never deletes a message that failed: SQS's own redrive moves it to
the dead-letter queue after the queue's ``maxReceiveCount`` receives.

On SIGTERM the worker stops receiving, hands back any message it received
but did not start, and finishes the requests in flight before it exits.
Logs are one JSON object per line and never contain an API key or a body.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from enum import Enum
from types import FrameType
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from .batch_settings import MAX_RECEIVE_BATCH, REQUEST_ID_PATTERN, BatchRequest, WorkerSettings
from .guard import parse_keys_file  # the secrets of [<id>:]<secret> lines

logger = logging.getLogger("inference_server.batch_worker")

CHAT_PATH = "/chat/completions"
# Answers that may succeed when asked again: timeouts, conflicts, rate limits.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})
# SQS caps a message's visibility timeout at 12 hours.
MAX_VISIBILITY_SECONDS = 43200
# Pause after a failed receive (throttling, a network blip) before the next.
RECEIVE_ERROR_PAUSE_SECONDS = 5.0


class SqsClient(Protocol):
    """The calls the worker makes on a boto3 SQS client."""

    def receive_message(self, **kwargs: Any) -> dict[str, Any]: ...

    def delete_message(self, **kwargs: Any) -> Any: ...

    def change_message_visibility(self, **kwargs: Any) -> Any: ...


class S3Client(Protocol):
    """The call the worker makes on a boto3 S3 client."""

    def put_object(self, **kwargs: Any) -> Any: ...


class Outcome(Enum):
    """What became of one message."""

    SUCCEEDED = "succeeded"  # answered, result written, message deleted
    FAILED = "failed"  # can never succeed: error written as the result, message deleted
    RETRY = "retry"  # left on the queue for another attempt
    REJECTED = "rejected"  # unreadable: left on the queue until SQS moves it to the dead-letter queue


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        doc.update(getattr(record, "fields", {}))
        if record.exc_info and record.exc_info[0] is not None:
            doc["exception"] = record.exc_info[0].__name__
        return json.dumps(doc, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    """One JSON object per line on stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx and botocore log each request at INFO/DEBUG; the worker logs its own outcome.
    for noisy in ("httpx", "httpcore", "botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log(level: int, event: str, **fields: Any) -> None:
    logger.log(level, event, extra={"fields": fields})


class KeySource(Protocol):
    """Where the worker gets the API key for each request."""

    def key(self) -> str: ...

    def refused(self, key: str) -> None: ...


class ApiKeyFile:
    """The API keys in the mounted key file, read again whenever the file changes.

    The file is the worker's own Secret: its key, ``batch-worker:<secret>``,
    which the server's keys file lists too, so the access log and the per-key
    metrics tell batch traffic from clients' (``[<id>:]<secret>`` a line,
    ``#`` comments; :mod:`.api_keys`). The worker sends the first key that the server has not
    refused. A 401 marks the key refused and makes the next request read the
    file again, so a rotation works in either order: when the worker's copy
    of the Secret changes first, the other key still in the file is tried;
    when every key was refused, all are tried again (the server may not have
    reloaded its copy yet). Keys are never logged.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: list[str] = []
        self._refused: set[str] = set()
        self._stale = False
        self._reload()
        if not self._keys:
            raise ValueError(f"no API key in {path}")

    def _stamp_now(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path)  # follows the Secret volume's symlinks
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _reload(self) -> None:
        stamp = self._stamp_now()
        try:
            with open(self._path, encoding="utf-8") as handle:
                keys = parse_keys_file(handle.read())
        except OSError as err:
            # Mid-swap or briefly absent: keep the keys we have.
            _log(logging.WARNING, "api_keys_unreadable", error=type(err).__name__)
            return
        if not keys:
            _log(logging.WARNING, "api_keys_empty")
            return
        self._stamp, self._stale = stamp, False
        if keys != self._keys:
            self._keys = keys
            self._refused.clear()
            _log(logging.INFO, "api_keys_loaded", keys=len(keys))

    def key(self) -> str:
        with self._lock:
            if self._stale or self._stamp_now() != self._stamp:
                self._reload()
            usable = [k for k in self._keys if k not in self._refused]
            if not usable:
                self._refused.clear()
                usable = self._keys
            return usable[0]

    def refused(self, key: str) -> None:
        with self._lock:
            self._refused.add(key)
            self._stale = True


_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def readable_request_id(raw: str) -> str | None:
    """The ``id`` of a message that is not a valid request, when it has a usable one."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    if isinstance(value, str) and _REQUEST_ID.fullmatch(value):
        return value
    return None


def retry_delay(settings: WorkerSettings, receives: int) -> int:
    """How long a failed message stays hidden: doubles with each receive, capped by SQS."""
    return int(min(settings.retry_delay_seconds * 2 ** max(receives - 1, 0), MAX_VISIBILITY_SECONDS))


class BatchWorker:
    """Receives, answers and settles messages with bounded concurrency."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        sqs: SqsClient,
        s3: S3Client,
        http: httpx.Client,
        keys: KeySource,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._sqs = sqs
        self._s3 = s3
        self._http = http
        self._keys = keys
        self._now = now

    # --- one message -------------------------------------------------------------------------

    def handle(self, message: Mapping[str, Any]) -> Outcome:
        """Answer one SQS message and settle it (delete, or leave for a retry)."""
        message_id = str(message.get("MessageId", ""))
        receipt = str(message["ReceiptHandle"])
        receives = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        started = self._now()
        fields: dict[str, Any] = {"message_id": message_id, "receives": receives}

        raw = str(message.get("Body", ""))
        try:
            request = BatchRequest.model_validate_json(raw)
        except ValidationError as err:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
            request_id = readable_request_id(raw)
            if request_id is None:
                # No id, so no result object the sender could find: the
                # dead-letter queue is where this message can be seen.
                return self._reject(receipt, {**fields, "reason": "unreadable_message"})
            fields["request_id"] = request_id
            return self._fail(receipt, request_id, None, "invalid_request", problem, fields, receives)
        fields["request_id"] = request.id

        body = dict(request.body)
        if body.get("stream"):
            return self._fail(
                receipt, request.id, None, "invalid_request", "stream is not offered in batch", fields, receives
            )
        model = body.setdefault("model", self.settings.model)
        if model != self.settings.model:
            return self._fail(
                receipt,
                request.id,
                None,
                "model_not_found",
                f"this queue serves model '{self.settings.model}', not '{model}'",
                fields,
                receives,
            )

        api_key = self._keys.key()
        try:
            response = self._http.post(
                CHAT_PATH,
                json=body,
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=self.settings.request_timeout_seconds,
            )
        except httpx.TimeoutException:
            return self._retry(receipt, receives, {**fields, "reason": "timeout"})
        except httpx.TransportError as err:
            return self._retry(receipt, receives, {**fields, "reason": type(err).__name__})

        fields["status_code"] = response.status_code
        fields["duration_ms"] = round((self._now() - started) * 1000)
        code = response.status_code
        if code == 401:
            # A key being rotated: the server and this worker see the new
            # Secret at different moments. Read the key file again and retry.
            self._keys.refused(api_key)
            return self._retry(receipt, receives, {**fields, "reason": "http_401"})
        if code >= 500 or code in RETRYABLE_4XX:
            return self._retry(receipt, receives, {**fields, "reason": f"http_{code}"})
        try:
            payload: Any = response.json()
        except ValueError:
            if 200 <= code < 300:
                # A success without a readable answer: ask again rather than store nothing.
                return self._retry(receipt, receives, {**fields, "reason": "unreadable_response"})
            payload = None
        if 200 <= code < 300:
            result = self._result(request.id, Outcome.SUCCEEDED, code, receives, response=payload)
            return self._settle(receipt, result, Outcome.SUCCEEDED, fields)
        error = payload.get("error") if isinstance(payload, dict) else None
        result = self._result(
            request.id,
            Outcome.FAILED,
            code,
            receives,
            error=error if isinstance(error, dict) else {"message": f"HTTP {code}", "type": "http_error"},
        )
        return self._settle(receipt, result, Outcome.FAILED, fields)

    def _result(
        self,
        request_id: str,
        outcome: Outcome,
        status_code: int | None,
        receives: int,
        *,
        response: Any = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "status": outcome.value,
            "status_code": status_code,
            "model": self.settings.model,
            "response": response,
            "error": error,
            "attempts": receives,
            "completed_at": datetime.fromtimestamp(self._now(), UTC).isoformat(timespec="seconds"),
        }

    def _fail(
        self,
        receipt: str,
        key_id: str,
        status_code: int | None,
        error_type: str,
        message: str,
        fields: dict[str, Any],
        receives: int = 1,
    ) -> Outcome:
        result = self._result(
            key_id, Outcome.FAILED, status_code, receives, error={"message": message, "type": error_type}
        )
        return self._settle(receipt, result, Outcome.FAILED, {**fields, "reason": error_type})

    def _settle(self, receipt: str, result: dict[str, Any], outcome: Outcome, fields: dict[str, Any]) -> Outcome:
        key = self.settings.result_key(str(result["id"]))
        try:
            self._s3.put_object(
                Bucket=self.settings.results_bucket,
                Key=key,
                Body=json.dumps(result).encode(),
                ContentType="application/json",
            )
        except Exception:
            # Without a stored result the message must stay: it is retried.
            _log(logging.ERROR, "result_write_failed", **fields, result_key=key)
            return Outcome.RETRY
        try:
            self._sqs.delete_message(QueueUrl=self.settings.queue_url, ReceiptHandle=receipt)
        except Exception:
            # The result is stored; a second delivery overwrites it with the same answer.
            _log(logging.WARNING, "delete_failed", **fields, result_key=key)
        _log(
            logging.INFO if outcome is Outcome.SUCCEEDED else logging.WARNING,
            f"request_{outcome.value}",
            **fields,
            result_key=key,
        )
        return outcome

    def _visible_again_in(self, receipt: str, delay: int) -> int:
        """Make the message visible again after `delay` seconds; -1 when SQS refused the change."""
        try:
            self._sqs.change_message_visibility(
                QueueUrl=self.settings.queue_url, ReceiptHandle=receipt, VisibilityTimeout=delay
            )
        except Exception:
            # The queue's own visibility timeout then decides when it comes back.
            return -1
        return delay

    def _retry(self, receipt: str, receives: int, fields: dict[str, Any]) -> Outcome:
        delay = self._visible_again_in(receipt, retry_delay(self.settings, receives))
        _log(logging.WARNING, "request_retry", **fields, retry_in_seconds=delay)
        return Outcome.RETRY

    def _reject(self, receipt: str, fields: dict[str, Any]) -> Outcome:
        """Leave an unreadable message for SQS's redrive, visible again after the first retry delay.

        No back-off: the message will not get better, so it reaches the
        dead-letter queue after maxReceiveCount receives, in minutes.
        """
        delay = self._visible_again_in(receipt, self.settings.retry_delay_seconds)
        _log(logging.ERROR, "message_rejected", **fields, retry_in_seconds=delay)
        return Outcome.REJECTED

    # --- the loop ----------------------------------------------------------------------------

    def _process(self, message: Mapping[str, Any], slots: threading.Semaphore) -> None:
        try:
            self.handle(message)
        except Exception:
            # Whatever broke, the message is still on the queue and comes back.
            logger.exception("request_crashed", extra={"fields": {"message_id": message.get("MessageId")}})
        finally:
            slots.release()

    def _receive(self, count: int) -> list[dict[str, Any]]:
        response = self._sqs.receive_message(
            QueueUrl=self.settings.queue_url,
            MaxNumberOfMessages=count,
            WaitTimeSeconds=self.settings.wait_seconds,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        return list(response.get("Messages", []))

    def _hand_back(self, messages: list[dict[str, Any]]) -> None:
        """Make messages received during shutdown visible to other workers at once."""
        for m in messages:
            try:
                self._sqs.change_message_visibility(
                    QueueUrl=self.settings.queue_url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0
                )
            except Exception:
                _log(logging.WARNING, "hand_back_failed", message_id=m.get("MessageId"))

    def run(self, stop: threading.Event) -> None:
        """Receive and answer until `stop` is set, then drain the requests in flight."""
        limit = self.settings.concurrency
        slots = threading.BoundedSemaphore(limit)
        _log(logging.INFO, "worker_started", concurrency=limit, model=self.settings.model)
        with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="batch") as pool:
            while not stop.is_set():
                # Receive only as many messages as there are free slots: a
                # message waiting in this process would run down its visibility
                # timeout while another worker could have answered it.
                if not slots.acquire(timeout=1.0):
                    continue
                if stop.is_set():
                    # Stopped while waiting for a free slot: receive nothing more.
                    slots.release()
                    break
                taken = 1
                while taken < min(limit, MAX_RECEIVE_BATCH) and slots.acquire(blocking=False):
                    taken += 1
                try:
                    messages = self._receive(taken)
                except Exception as err:
                    for _ in range(taken):
                        slots.release()
                    _log(logging.WARNING, "receive_failed", error=type(err).__name__)
                    stop.wait(RECEIVE_ERROR_PAUSE_SECONDS)
                    continue
                for _ in range(taken - len(messages)):
                    slots.release()
                if stop.is_set():
                    self._hand_back(messages)
                    for _ in messages:
                        slots.release()
                    break
                for m in messages:
                    pool.submit(self._process, m, slots)
            _log(logging.INFO, "worker_draining")
        _log(logging.INFO, "worker_stopped")


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM (the kubelet) and SIGINT stop receiving; requests in flight finish."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _log(logging.INFO, "signal_received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main() -> int:
    """Entry point: read the settings, connect, run until told to stop."""
    configure_logging()
    settings = WorkerSettings.from_env(os.environ)
    keys = ApiKeyFile(settings.api_keys_file)

    import boto3  # the image has it; tests use fakes and never import it
    from botocore.config import Config

    aws_config = Config(
        region_name=settings.region,
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=5,
        # A long poll holds the connection for wait_seconds.
        read_timeout=settings.wait_seconds + 10,
        max_pool_connections=settings.concurrency + 2,
    )
    sqs = boto3.client("sqs", config=aws_config)
    s3 = boto3.client("s3", config=aws_config)
    stop = threading.Event()
    install_signal_handlers(stop)
    limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
    with httpx.Client(base_url=settings.base_url, limits=limits, timeout=settings.request_timeout_seconds) as http:
        BatchWorker(settings, sqs=sqs, s3=s3, http=http, keys=keys).run(stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
