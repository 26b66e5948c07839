"""Streamed chat completions sent back to back by a few clients, each outcome kept: the load of the live checks.

Each client is the official ``openai`` client with its keep-alive pool and
no retries, so a request the server side drops counts as failed. An
optional prober asks a health path twice a second, as a readiness probe
would, and keeps what it saw.
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from localserve.server import LIMIT_MAX_TOKENS, MODEL_ID

# The loggers of the HTTP clients: openai's (it sends through httpx2) and httpx. Each logs every
# request at INFO; under load, a line per request buried the twin's check lines, and a failure's
# tail, in its log. The outcomes are kept instead.
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2")


def quiet_http_client_logs() -> None:
    """Leaves the HTTP clients' per-request INFO lines out of this process's log."""
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass
class Outcome:
    """One request: when it started and ended, whether it was served whole, and why not."""

    started: float
    ended: float
    ok: bool
    error: str = ""


@dataclass
class StreamLoad:
    """`streams` threads sending streamed chat completions, `think_s` apart, until stopped."""

    base_url: str
    api_key: str
    streams: int
    timeout_s: float = 60.0
    think_s: float = 0.0
    max_tokens: int = LIMIT_MAX_TOKENS
    prompt: str = "Tell me about fault tolerance."
    model: str = MODEL_ID
    # Each request's prompt starts with its own number, so vLLM's prefix
    # cache shares none of its KV blocks with another request's.
    distinct: bool = False
    # The generation runs to max_tokens (same work every request).
    ignore_eos: bool = True
    health_path: str | None = None
    # Every other client asks without streaming: its whole answer is read, so
    # its keep-alive connection certainly carries the next request.
    mixed: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    health: list[tuple[float, bool]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0
    _abandon: bool = False

    def start(self) -> None:
        quiet_http_client_logs()
        self._threads = [
            threading.Thread(target=self._run, args=(self.mixed and i % 2 == 1,), daemon=True)
            for i in range(self.streams)
        ]
        if self.health_path is not None:
            self._threads.append(threading.Thread(target=self._probe_health, daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float, *, abandon: bool = False) -> list[threading.Thread]:
        """Stop and join; returns the threads still running after `timeout_s` (hung requests).

        ``abandon``: each stream in flight is closed at its next chunk and kept
        as no outcome, so the server drops it (vLLM aborts a request whose
        client went away) instead of generating to the end for nobody.
        """
        self._abandon = abandon
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive()]

    def done(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def last_error(self) -> str:
        """`; last error: ...` when a request failed, else nothing (for a report line)."""
        failed = [o for o in self.done() if not o.ok]
        return f"; last error: {failed[-1].error}" if failed else ""

    def wait_served(self, count: int, since: float, timeout_s: float) -> bool:
        """Until `count` requests started at or after `since` were served; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(o.ok and o.started >= since for o in self.done()) >= count:
                return True
            time.sleep(0.2)
        return False

    def _prompt(self) -> str:
        if not self.distinct:
            return self.prompt
        with self._lock:
            self._sent += 1
            return f"{self._sent} {self.prompt}"

    def _one(self, client: Any, whole: bool = False) -> Outcome | None:
        started = time.monotonic()
        prompt = self._prompt()
        try:
            if whole:
                answer = client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_tokens,
                    extra_body={"ignore_eos": self.ignore_eos},
                )
                if not answer.choices or answer.choices[0].finish_reason is None:
                    return Outcome(started, time.monotonic(), False, "answer without a finish_reason")
                return Outcome(started, time.monotonic(), True)
            finish = None
            # Closed when read. openai's sync stream stops at [DONE] without
            # draining the body, so its connection is dropped, not pooled: only
            # the `mixed` load's whole-answer clients keep theirs.
            with client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": self.ignore_eos},
            ) as stream:
                for chunk in stream:
                    if self._abandon and self._stop.is_set():
                        return None
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
            if finish is None:
                return Outcome(started, time.monotonic(), False, "stream ended without a finish_reason")
            return Outcome(started, time.monotonic(), True)
        except Exception as err:  # any failure counts; the caller reports it
            return Outcome(started, time.monotonic(), False, f"{type(err).__name__}: {err}"[:300])

    def _run(self, whole: bool = False) -> None:
        import openai

        # Each stream keeps its own client and keep-alive pool; only the TLS
        # context is shared. httpx builds one per client by default, loading
        # the CA bundle (45 ms of CPU idle): 160 streams started beside a
        # loaded server took 84 s to begin, so the load came long after its
        # fault's clock started.
        http = openai.DefaultHttpxClient(verify=_tls_context())
        client = openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s, max_retries=0, http_client=http
        )
        while not self._stop.is_set():
            outcome = self._one(client, whole)
            if outcome is None:
                return
            with self._lock:
                self.outcomes.append(outcome)
            time.sleep(self.think_s if outcome.ok else max(self.think_s, 0.25))

    def _probe_health(self) -> None:
        """What the serving pod's readiness probe asks (Serve's proxy, or the replica's vLLM server)."""
        url = self.base_url.removesuffix("/v1") + str(self.health_path)
        while not self._stop.wait(0.5):
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    healthy = response.status == 200
            except (urllib.error.URLError, OSError):
                healthy = False
            with self._lock:
                self.health.append((time.monotonic(), healthy))


def abandon_all(loads: list[StreamLoad], timeout_s: float) -> list[threading.Thread]:
    """Stops every load at once, abandoning their streams in flight; the threads still running after ``timeout_s``.

    Stopped one after another, each load's streams generate on while the
    loads before it are joined, and the server keeps working for nobody.
    """
    for load in loads:
        load.stop(timeout_s=0, abandon=True)
    deadline = time.monotonic() + timeout_s
    return [hung for load in loads for hung in load.stop(timeout_s=max(0.0, deadline - time.monotonic()), abandon=True)]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every client of the process (an SSLContext is safe to share)."""
    return ssl.create_default_context()
