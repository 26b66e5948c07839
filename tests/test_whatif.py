"""The what-if replay's parts without a server: the trace format, the generator, the counters, the report."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks.traces import (
    CHAT,
    COMPLETIONS,
    PrefixTraceSpec,
    TracedRequest,
    TraceError,
    read_trace,
    write_trace,
)
from benchmarks.whatif import (
    CacheCounts,
    PolicyResult,
    Sent,
    cache_counts,
    kv_cache_bytes,
    one_line,
    salted,
    summarize,
)
from infra.config.routing import ROUTING_KEY_HEADER

METRICS = """# HELP vllm:prefix_cache_hits_total hits
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1536.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
"""


def test_a_trace_round_trips_and_is_read_in_time_order(tmp_path: Path) -> None:
    requests = [
        TracedRequest(1.5, CHAT, {"model": "m", "messages": [{"role": "user", "content": "b"}]}),
        TracedRequest(0.0, COMPLETIONS, {"model": "m", "prompt": "a"}),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, requests) == 2
    assert read_trace(path) == sorted(requests, key=lambda r: r.t)
    assert '"path"' not in path.read_text().splitlines()[1]  # completions is the default


def test_a_traces_headers_round_trip_and_default_to_none(tmp_path: Path) -> None:
    keyed = TracedRequest(0.5, COMPLETIONS, {"model": "m", "prompt": "a"}, {ROUTING_KEY_HEADER: "support-bot"})
    plain = TracedRequest(0.0, COMPLETIONS, {"model": "m", "prompt": "b"})
    path = tmp_path / "t.jsonl"
    write_trace(path, [plain, keyed])
    assert read_trace(path) == [plain, keyed]
    assert '"headers"' not in path.read_text().splitlines()[0]


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("not json", "not JSON"),
        ('{"t": "1", "body": {"prompt": "a"}}', "`t` must be a number"),
        ('{"t": true, "body": {"prompt": "a"}}', "`t` must be a number"),
        ('{"t": -1, "body": {"prompt": "a"}}', "`t` must be a number"),
        ('{"t": 0, "body": "a"}', "`body` must be the OpenAI request object"),
        ('{"t": 0, "path": "/v1/embeddings", "body": {"input": "a"}}', "`path` must be one of"),
        ('{"t": 0, "path": "/v1/chat/completions", "body": {"prompt": "a"}}', "needs `messages`"),
        ('{"t": 0, "headers": ["X-Session-ID"], "body": {"prompt": "a"}}', "`headers` must map header names"),
        ('{"t": 0, "headers": {"X-Session-ID": 7}, "body": {"prompt": "a"}}', "`headers` must map header names"),
        ('{"t": 0, "headers": {"authorization": "Bearer k"}, "body": {"prompt": "a"}}', "may not carry Authorization"),
    ],
)
def test_a_bad_line_is_one_error_naming_it(tmp_path: Path, line: str, rule: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "body": {"prompt": "ok"}}\n' + line + "\n")
    with pytest.raises(TraceError, match=rule) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}:2: ")


def test_the_generated_trace_shares_its_prefixes() -> None:
    pytest.importorskip("vllm")
    from benchmarks.traces import prefix_trace
    from twin.model import tiny_model_dir

    spec = PrefixTraceSpec(requests=16, num_prefixes=4, prefix_len=256, suffix_len=128, rate=8.0)
    trace = prefix_trace(spec, tiny_model_dir(), "m")
    assert len(trace) == 16 and trace[0].t == 0.0
    assert all(b.t >= a.t for a, b in itertools.pairwise(trace))
    heads = {r.body["prompt"][:60] for r in trace}
    assert len(heads) == 4  # four prefixes, each shared by four prompts
    # Each request names its prefix in the routing key, one key per prefix.
    keys = {
        r.body["prompt"][:60]: {
            q.headers[ROUTING_KEY_HEADER] for q in trace if q.body["prompt"][:60] == r.body["prompt"][:60]
        }
        for r in trace
    }
    assert all(len(k) == 1 for k in keys.values())
    assert len({next(iter(k)) for k in keys.values()}) == 4
    assert all(r.body["max_tokens"] == spec.output_len for r in trace)


def test_cache_counts_sum_every_label_set() -> None:
    assert cache_counts(METRICS) == CacheCounts(1536.0, 4096.0, 4.0)
    # Prometheus 2's OpenMetrics names (vllm_ instead of vllm:) read the same.
    assert cache_counts(METRICS.replace("vllm:", "vllm_")) == CacheCounts(1536.0, 4096.0, 4.0)


def test_salt_goes_in_front_of_every_prompt_and_the_answer_is_streamed() -> None:
    body = salted(TracedRequest(0, COMPLETIONS, {"prompt": ["a", "b"], "stream": False}), "[x] ")
    assert body["prompt"] == ["[x] a", "[x] b"] and body["stream"] is True
    chat = salted(TracedRequest(0, CHAT, {"messages": [{"role": "system", "content": "sys"}]}), "[x] ")
    assert chat["messages"][0]["content"] == "[x] sys"
    assert chat["stream_options"] == {"include_usage": True}


def test_summary_is_the_fleets_hit_rate_and_the_clients_latencies() -> None:
    before = [CacheCounts(100, 1000, 10), CacheCounts(0, 0, 0)]
    after = [CacheCounts(700, 2000, 14), CacheCounts(300, 2000, 12)]
    sent = [Sent(0.0, 0.010, 1.0, 8), Sent(0.5, 0.030, 2.0, 8), Sent(1.0, None, 1.5, 0, "HTTP 429: busy")]
    result = summarize("cache_aware", sent, before, after)
    assert result.hit_rate == pytest.approx(900 / 3000)
    assert (result.prefill_tokens_saved, result.prefill_tokens) == (900, 3000)
    assert result.replica_requests == [4, 12]
    assert (result.errors, result.first_error) == (1, "HTTP 429: busy")
    assert result.ttft_p50_ms == pytest.approx(20.0)
    assert result.requests_per_s == pytest.approx(1.0) and result.output_tokens_per_s == pytest.approx(8.0)


def test_the_one_line_result_gives_prefix_routings_gain_over_round_robin() -> None:
    def result(policy: str, hit: float) -> PolicyResult:
        return PolicyResult(policy, 10, 0, hit, 0, 0, 12.0, 20.0, 1.0, 8.0, [5, 5])

    line = one_line("prod", [result("cache_aware", 0.5), result("round_robin", 0.25), result("consistent_hash", 0.55)])
    assert line.startswith("what-if (prod): cache_aware hit 50% TTFT p50 12 ms; round_robin hit 25%")
    assert line.endswith("hit rate over round_robin: cache_aware 2.00x, consistent_hash 2.20x")
    # Without round robin in the replay there is nothing to compare with.
    assert "over round_robin" not in one_line("prod", [result("cache_aware", 0.5)])


def test_the_replay_sends_the_traces_headers_with_its_own_key(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler

    from benchmarks.whatif import send
    from tests.e2e.loopback_http import LoopbackHttp, answer

    seen: list[tuple[str | None, str | None]] = []

    class Replica(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            seen.append((self.headers.get(ROUTING_KEY_HEADER), self.headers.get("authorization")))
            body = (
                b'data: {"choices": [{"text": "hi"}]}\n\ndata: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
            )
            answer(self, 200, body, "text/event-stream")

    server = LoopbackHttp(Replica)
    try:
        request = TracedRequest(0, COMPLETIONS, {"model": "m", "prompt": "a"}, {ROUTING_KEY_HEADER: "support-bot"})
        sent = send(server.base_url + "/v1", "k", request, "[x] ")
    finally:
        server.stop()
    assert sent.error is None and sent.output_tokens == 1
    assert seen == [("support-bot", "Bearer k")]


def test_the_recorded_report_gives_the_preview_its_one_line_result(tmp_path: Path) -> None:
    from benchmarks.whatif import record
    from infra.config.routing import recorded_whatif

    def result(policy: str, hit: float) -> PolicyResult:
        return PolicyResult(policy, 10, 0, hit, 0, 0, 12.0, 20.0, 1.0, 8.0, [5, 5])

    results = [result("cache_aware", 0.5), result("round_robin", 0.25)]
    report = tmp_path / "prod.json"
    report.write_text(record("prod", Path("prefix.jsonl"), 2, 4096, results))
    assert recorded_whatif(str(report)) == one_line("prod", results)
    assert json.loads(report.read_text())["results"][0]["policy"] == "cache_aware"


def test_kv_cache_bytes_follow_the_models_shape(tmp_path: Path) -> None:
    config = {"hidden_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # K and V, 2 layers, 2 KV heads of 64, float32: 2048 bytes a token.
    assert kv_cache_bytes(tmp_path, 4096) == 4096 * 2048


def test_an_event_with_a_unicode_line_separator_in_its_text_stays_whole() -> None:
    from benchmarks.whatif import sse_events

    event = json.dumps({"choices": [{"text": "a\u2028b\x85c"}]}, ensure_ascii=False)
    stream = [f"data: {event[:10]}", event[10:] + "\n\ndata: [DONE]\n\n"]
    assert list(sse_events(stream)) == [{"choices": [{"text": "a\u2028b\x85c"}]}]
