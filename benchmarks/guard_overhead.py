"""The guard's own cost, in isolation: ApiGuard in front of a dummy streaming ASGI app.

    python -m benchmarks.guard_overhead [--requests 20000]

Calls the ASGI app directly (no server, no sockets), so what is left is the
guard's work per request: header lookup, SHA-256 of the presented key and
constant-time compares, buffering the body, one JSON parse, the limit checks
and the replayed ``receive``. The dummy app reads the body and streams
``chunks`` response chunks, like a streamed chat completion; the guard does
not wrap ``send``, so its cost must not grow with the chunks.
Alternates guarded and unguarded batches and reports the median difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "workloads") not in sys.path:
    sys.path.insert(0, str(REPO / "workloads"))

from inference_server.catalog import RequestLimits  # noqa: E402
from inference_server.guard import ApiGuard, ApiKeys  # noqa: E402

from benchmarks.stats import median  # noqa: E402

KEY = "bench-" + "k" * 40
# A realistic key list: the request's key is the last of ten.
KEYS = ",".join([f"other-{i:02d}-" + "x" * 40 for i in range(9)] + [KEY])


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


def make_app(chunks: int) -> Any:
    chunk = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'

    async def app(scope: Any, receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def drive(app: Any, body: bytes, n: int) -> float:
    """Seconds for ``n`` sequential requests through ``app``."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
    }

    async def send(message: Any) -> None:
        return None

    started = time.perf_counter()
    for _ in range(n):
        sent = False

        async def receive() -> Any:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, receive, send)
    return time.perf_counter() - started


@dataclass
class GuardCase:
    prompt_bytes: int
    chunks: int
    bare_us: float
    guarded_us: float
    added_us: float
    added_us_min: float
    added_us_max: float


def measure(prompt_bytes: int, chunks: int, requests: int, batches: int = 7) -> GuardCase:
    inner = make_app(chunks)
    guarded = ApiGuard(
        inner,
        keys=ApiKeys(None, "BENCH_KEYS", environ={"BENCH_KEYS": KEYS}),
        limits=RequestLimits(max_tokens=64, max_prompt_tokens=100_000),
    )
    body = chat_body(prompt_bytes)
    per = max(1, requests // batches)
    bare_t: list[float] = []
    guard_t: list[float] = []
    asyncio.run(drive(guarded, body, per // 4 + 1))  # warm both paths
    for _ in range(batches):
        bare_t.append(asyncio.run(drive(inner, body, per)) / per * 1e6)
        guard_t.append(asyncio.run(drive(guarded, body, per)) / per * 1e6)
    added = [g - b for g, b in zip(guard_t, bare_t, strict=True)]
    return GuardCase(prompt_bytes, chunks, median(bare_t), median(guard_t), median(added), min(added), max(added))


def run(requests: int = 20000) -> list[GuardCase]:
    return [measure(p, c, requests) for p, c in ((100, 32), (100, 256), (8_000, 32), (100_000, 32))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args(argv)
    for case in run(args.requests):
        print(json.dumps(asdict(case)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
