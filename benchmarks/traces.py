"""Request traces for the what-if replay: the file format, its reader, and a shared-prefix generator.

A trace is JSON Lines, one request per line, in the order sent::

    {"t": 0.00, "body": {"model": "m", "prompt": "...", "max_tokens": 32}}
    {"t": 0.41, "path": "/v1/chat/completions", "body": {"model": "m", "messages": [...]}}
    {"t": 0.90, "headers": {"X-Session-ID": "support-bot"}, "body": {...}}

``t`` is the second it is sent at, from the trace's start; ``path`` is
``/v1/completions`` unless given; ``body`` is the OpenAI request as a client
sent it (``stream`` is set by the replay, which measures the first token);
``headers``, optional, are HTTP headers the client sent with it: the routing
key the ``consistent_hash`` policy reads (``X-Session-ID``, naming the
prompt's shared prefix or the conversation) is one. ``Authorization`` is the
replay's own and may not be given.

The generator writes the standard case from vLLM's own ``prefix_repetition``
benchmark dataset (vllm/benchmarks/datasets: random prompts of
``prefix_len`` shared and ``suffix_len`` own tokens, ``num_prefixes``
prefixes, shuffled), at Poisson arrivals of ``rate`` requests a second.
Each request carries the routing key a client that knows its template would
send: ``X-Session-ID`` naming its prefix.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.config.routing import ROUTING_KEY_HEADER

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PATHS = (COMPLETIONS, CHAT)


class TraceError(ValueError):
    """A trace line that can not be replayed; the message names the file, the line and the rule."""


@dataclass(frozen=True)
class TracedRequest:
    """One request of a trace."""

    t: float
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def read_trace(path: Path) -> list[TracedRequest]:
    """The trace's requests in time order; a bad line raises TraceError naming it."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: a line is an object with `t` and `body`")
        t, body, route = record.get("t"), record.get("body"), record.get("path", COMPLETIONS)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise TraceError(f"{where}: `t` must be a number of seconds >= 0")
        if not isinstance(body, dict):
            raise TraceError(f"{where}: `body` must be the OpenAI request object")
        if route not in PATHS:
            raise TraceError(f"{where}: `path` must be one of {', '.join(PATHS)}")
        key = "prompt" if route == COMPLETIONS else "messages"
        if key not in body:
            raise TraceError(f"{where}: a {route} body needs `{key}`")
        headers = record.get("headers", {})
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise TraceError(f"{where}: `headers` must map header names to strings")
        if any(k.lower() == "authorization" for k in headers):
            raise TraceError(f"{where}: `headers` may not carry Authorization (the replay sends its own key)")
        out.append(TracedRequest(float(t), route, body, dict(headers)))
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.t)


def write_trace(path: Path, requests: Iterable[TracedRequest]) -> int:
    """Writes ``requests`` as a trace file; returns how many."""
    lines = []
    for r in requests:
        record: dict[str, Any] = {"t": round(r.t, 4), "body": r.body}
        if r.path != COMPLETIONS:
            record["path"] = r.path
        if r.headers:
            record["headers"] = r.headers
        lines.append(json.dumps(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


@dataclass(frozen=True)
class PrefixTraceSpec:
    """The shape of a shared-prefix trace (vLLM's prefix_repetition dataset)."""

    requests: int = 288
    prefix_len: int = 512
    # 512 + 416 prompt tokens and 32 answered fit the tiny model's 1024 positions
    # with room for the what-if's salt and re-tokenization.
    suffix_len: int = 416
    num_prefixes: int = 48
    output_len: int = 32
    rate: float = 3.0
    seed: int = 0

    @property
    def shared_share(self) -> float:
        """The share of each prompt's tokens that is a shared prefix."""
        return self.prefix_len / (self.prefix_len + self.suffix_len)


def prefix_trace(spec: PrefixTraceSpec, model_dir: Path, model_id: str) -> list[TracedRequest]:
    """A shared-prefix trace from vLLM's prefix_repetition dataset, with the model's own tokenizer.

    Each request names its prefix in the routing key (``prefix-<n>``). The
    dataset makes each prefix's prompts in turn and then shuffles them with
    the process's `random`, which it seeded; its shuffle is turned off here
    and the same draw shuffles the prompts with their prefix's number, so the
    prompts and their order are the dataset's own.
    """
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset = PrefixRepetitionRandomDataset(random_seed=spec.seed)
    dataset.disable_shuffle = True  # sample() reads it with getattr
    samples = dataset.sample(
        tokenizer,
        spec.requests,
        prefix_len=spec.prefix_len,
        suffix_len=spec.suffix_len,
        num_prefixes=spec.num_prefixes,
        output_len=spec.output_len,
    )
    per_prefix = spec.requests // spec.num_prefixes
    numbered = [(n // per_prefix, sample.prompt) for n, sample in enumerate(samples)]
    random.shuffle(numbered)
    arrivals = random.Random(spec.seed)
    t = 0.0
    out = []
    for prefix, prompt in numbered:
        out.append(
            TracedRequest(
                t,
                COMPLETIONS,
                {"model": model_id, "prompt": prompt, "max_tokens": spec.output_len, "temperature": 0},
                {ROUTING_KEY_HEADER: f"prefix-{prefix}"},
            )
        )
        t += arrivals.expovariate(spec.rate)
    return out
