"""The project's own per-request code, in isolation, in front of a dummy streaming ASGI app.

    python -m benchmarks.guard_overhead [--requests 20000]

Calls the ASGI app directly (no server, no sockets), so what is left is the
project's work per request. Two stacks:

* ``guard``: ApiGuard alone: header lookup, SHA-256 of the presented key and
  constant-time compares, buffering the body, one JSON parse, the limit
  checks, the replayed ``receive``, and its ``send`` that reshapes error
  answers (a pass-through for a 200);
* ``server``: everything the vllm-server process puts in front of vLLM's app
  (``VllmServerGuard``, configured as the replica configures it): the drain
  files' check, the per-key in-flight cap, the reading of every answer chunk
  for the model, the usage and the token count, the access log line (to a
  file) and the per-key counters, then the guard. Its chunks are the
  events vLLM's own serving code writes for a streamed completion, so its
  per-chunk cost is the one a token pays.

The dummy app reads the body and streams ``chunks`` response chunks.
Alternates the stack's batches with the app's alone and reports the median difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "workloads") not in sys.path:
    sys.path.insert(0, str(REPO / "workloads"))

from inference_server.catalog import RequestLimits  # noqa: E402
from inference_server.fairness import AccessLog  # noqa: E402
from inference_server.guard import ApiGuard, ApiKeys  # noqa: E402
from inference_server.vllm_guard import (  # noqa: E402
    DRAIN_FILE_ENV,
    NODE_DRAIN_FILE_ENV,
    SETTINGS_ENV,
    ServerGuardSettings,
    VllmServerGuard,
)

from benchmarks.stats import median  # noqa: E402

KEY = "bench-" + "k" * 40
# A realistic key list: the request's key is the last of ten.
KEYS = ",".join([f"other-{i:02d}-" + "x" * 40 for i in range(9)] + [KEY])
KEYS_ENV = "BENCH_KEYS"
MODEL = "tiny-llama"
# The prompt bytes the server stack is measured at: few enough that the byte
# bounds decide the prompt's size, as they do for the serving benchmark's
# prompts (a prompt they can not decide is counted by vLLM's tokenizer, which
# needs a running server).
SERVER_PROMPT_BYTES = 100


def chat_body(prompt_bytes: int) -> bytes:
    return json.dumps(
        {
            "model": "tiny-llama",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "x" * prompt_bytes},
            ],
            "max_tokens": 32,
            "stream": True,
        }
    ).encode()


def completion_body(prompt_bytes: int) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": "x" * prompt_bytes, "max_tokens": 32, "stream": True, "temperature": 0}
    ).encode()


def vllm_stream_events(chunks: int) -> list[bytes]:
    """The events of a streamed completion of ``chunks`` tokens, made by vLLM's own protocol models."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    def event(i: int) -> bytes:
        finish = "length" if i == chunks - 1 else None
        choice = CompletionResponseStreamChoice(index=0, text=f" tok{i}", finish_reason=finish)
        chunk = CompletionStreamResponse(id="cmpl-bench", created=1, model=MODEL, choices=[choice])
        # As vLLM's serving code writes each one (completion/serving.py).
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n".encode()

    return [*(event(i) for i in range(chunks)), b"data: [DONE]\n\n"]


def make_app(chunks: int, events: list[bytes] | None = None, *, vllm_usage: bool = False) -> Any:
    """The dummy app: reads the body, then streams ``events`` (or ``chunks`` short chat chunks).

    With ``vllm_usage`` it leaves the usage in the request state as vLLM's
    serving code does (its own ``RequestResponseMetadata``: set on
    ``raw_request.state`` before the first chunk, ``final_usage_info`` after
    the last one), which is where the server stack's accounting reads a
    finished answer's tokens.
    """
    sent = events or [b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'] * chunks
    if vllm_usage:
        from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

    async def app(scope: Any, receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        metadata = None
        if vllm_usage:
            # What Starlette's `request.state` writes to: the scope's "state" dict.
            metadata = RequestResponseMetadata(request_id="cmpl-bench")
            scope.setdefault("state", {})["request_metadata"] = metadata
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in sent:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if metadata is not None:
            metadata.final_usage_info = UsageInfo(prompt_tokens=8, completion_tokens=chunks, total_tokens=8 + chunks)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def server_stack(app: Any, limits: RequestLimits, workdir: Path) -> VllmServerGuard:
    """The vllm-server process's middleware in front of ``app``, set up as the replica sets up its server.

    Its access log goes to a file in ``workdir`` (the server's goes to its
    stderr), and its drain files do not exist (a serving replica's do not).
    """
    settings = ServerGuardSettings(
        api_keys_file=None, api_keys_env=KEYS_ENV, limits=limits, model_ids=[MODEL], replica_inflight_cap=1000
    )
    environ = {
        KEYS_ENV: KEYS,
        SETTINGS_ENV: settings.model_dump_json(),
        DRAIN_FILE_ENV: str(workdir / "draining"),
        NODE_DRAIN_FILE_ENV: str(workdir / "node-draining"),
    }
    saved = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        stack = VllmServerGuard(app)
    finally:
        # The keys stay readable: ApiKeys reads its variable on each reload.
        for key, value in saved.items():
            if key != KEYS_ENV:
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    # The server writes its lines to its stderr: the same writes, to a file rather than this terminal.
    stack.accounting.log.close()
    stack.accounting.log = AccessLog(os.open(workdir / "access.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND))
    return stack


async def drive(app: Any, body: bytes, n: int, path: str = "/v1/chat/completions") -> float:
    """Seconds for ``n`` sequential requests through ``app``; every one must be answered 200.

    A refusal (a key the stack does not know, a limit) is answered in a few
    microseconds without the app: timing it would measure the refusal.
    """
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    statuses: set[int] = set()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            statuses.add(message["status"])

    started = time.perf_counter()
    for _ in range(n):
        sent = False

        async def receive() -> Any:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        # A scope of its own each time, as the server gives each request (the accounting adds a
        # request id), with the request state uvicorn gives each one (a copy of the app's).
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": list(headers), "state": {}}
        await app(scope, receive, send)
    elapsed = time.perf_counter() - started
    if statuses != {200}:
        raise RuntimeError(f"the measured app answered {sorted(statuses)}, not only 200: nothing to time")
    return elapsed


@dataclass
class GuardCase:
    stack: str
    prompt_bytes: int
    chunks: int
    bare_us: float
    guarded_us: float
    added_us: float
    added_us_min: float
    added_us_max: float


def measure(
    prompt_bytes: int, chunks: int, requests: int, batches: int = 7, stack: str = "guard", workdir: Path | None = None
) -> GuardCase:
    limits = RequestLimits(max_tokens=64, max_prompt_tokens=100_000)
    if stack == "guard":
        inner = make_app(chunks)
        guarded: Any = ApiGuard(inner, keys=ApiKeys(None, KEYS_ENV, environ={KEYS_ENV: KEYS}), limits=limits)
        body, path = chat_body(prompt_bytes), "/v1/chat/completions"
    else:
        assert workdir is not None
        inner = make_app(chunks, vllm_stream_events(chunks), vllm_usage=True)
        guarded = server_stack(inner, limits, workdir)
        body, path = completion_body(prompt_bytes), "/v1/completions"
    per = max(1, requests // batches)
    bare_t: list[float] = []
    guard_t: list[float] = []
    try:
        asyncio.run(drive(guarded, body, per // 4 + 1, path))  # warm both paths
        for _ in range(batches):
            bare_t.append(asyncio.run(drive(inner, body, per, path)) / per * 1e6)
            guard_t.append(asyncio.run(drive(guarded, body, per, path)) / per * 1e6)
    finally:
        if isinstance(guarded, VllmServerGuard):
            guarded.accounting.log.close()  # the access file server_stack opened
    added = [g - b for g, b in zip(guard_t, bare_t, strict=True)]
    return GuardCase(
        stack, prompt_bytes, chunks, median(bare_t), median(guard_t), median(added), min(added), max(added)
    )


def run(requests: int = 20000) -> list[GuardCase]:
    cases = [measure(p, c, requests) for p, c in ((100, 32), (100, 256), (8_000, 32), (100_000, 32))]
    with tempfile.TemporaryDirectory(prefix="guard-overhead-") as tmp:
        cases += [measure(SERVER_PROMPT_BYTES, c, requests, stack="server", workdir=Path(tmp)) for c in (32, 256)]
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args(argv)
    for case in run(args.requests):
        print(json.dumps(asdict(case)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
