"""Fast tests of the server's parts that need neither Ray nor vLLM: catalogue, engine mapping, guard."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from inference_server.catalog import Catalog, ModelEntry, RequestLimits, ServeAutoscaling
from inference_server.engine import S3_LOAD_FORMAT, llm_config_kwargs
from inference_server.guard import ApiGuard, ApiKeys, bearer_token, prompt_token_bound
from pydantic import ValidationError

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def entry(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model_id": "m", "source": "s3://models-bucket/llama", "max_model_len": 4096}
    base.update(overrides)
    return base


# ---------------------------------------------------------------- catalogue


def test_catalog_defaults_match_the_contract() -> None:
    catalog = Catalog.model_validate({"models": [entry()]})
    assert catalog.limits == RequestLimits(max_tokens=4096, max_prompt_tokens=32768)
    assert catalog.api_keys_file == "/etc/inference/api-keys/keys"
    assert catalog.api_keys_env == "INFERENCE_API_KEYS"
    assert catalog.allow_hub_download is False
    assert catalog.model_cache_dir == "/models"
    model = catalog.models[0]
    assert (model.tensor_parallel_size, model.pipeline_parallel_size, model.dtype) == (1, 1, "auto")
    assert model.gpu_memory_utilization == 0.9
    assert model.autoscaling == ServeAutoscaling()
    assert model.autoscaling.target_ongoing_requests == 16 and model.autoscaling.max_ongoing_requests == 64


def test_catalog_round_trips_through_json() -> None:
    catalog = Catalog.model_validate({"models": [entry(engine_overrides={"enforce_eager": True})]})
    again = Catalog.model_validate(json.loads(catalog.model_dump_json()))
    assert again == catalog


@pytest.mark.parametrize(
    ("source", "kind"),
    [("s3://models-bucket/llama/8b", "s3"), ("/models/llama", "local"), ("meta-llama/Llama-3.1-8B", "hub")],
)
def test_weights_kind(source: str, kind: str) -> None:
    assert ModelEntry.model_validate(entry(source=source)).weights_kind == kind


def test_hub_source_needs_allow_hub_download() -> None:
    hub = entry(source="meta-llama/Llama-3.1-8B")
    with pytest.raises(ValidationError, match="allow_hub_download"):
        Catalog.model_validate({"models": [hub]})
    assert Catalog.model_validate({"models": [hub], "allow_hub_download": True}).models[0].weights_kind == "hub"


@pytest.mark.parametrize(
    "bad",
    [
        {"source": "relative/path/x"},
        {"source": "gs://bucket/x"},
        {"source": "s3://"},
        {"max_model_len": 0},
        {"gpu_memory_utilization": 0},
        {"gpu_memory_utilization": 1.5},
        {"dtype": "int8"},
        {"tensor_parallel_size": 0},
        {"unknown_field": 1},
        {"engine_overrides": {"max_model_len": 10}},
        {"engine_overrides": {"nested": {"a": 1}}},
        {"model_id": ""},
    ],
)
def test_model_entry_rejects(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ModelEntry.model_validate(entry(**bad))


@pytest.mark.parametrize(
    "scaling",
    [
        {"min_replicas": 3, "max_replicas": 2},
        {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 5},
        {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1},
        {"target_ongoing_requests": 100, "max_ongoing_requests": 64},
        {"max_replicas": 0},
        {"target_ongoing_requests": 0},
    ],
)
def test_autoscaling_rejects(scaling: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ServeAutoscaling.model_validate(scaling)


def test_catalog_rejects_duplicates_and_empty() -> None:
    with pytest.raises(ValidationError, match="unique"):
        Catalog.model_validate({"models": [entry(), entry()]})
    with pytest.raises(ValidationError):
        Catalog.model_validate({"models": []})
    with pytest.raises(ValidationError):
        Catalog.model_validate({"models": [entry()], "extra": True})


def test_catalog_imports_with_pydantic_alone() -> None:
    code = (
        "import sys\n"
        "import workloads.inference_server.catalog as c\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'ray', 'vllm', 'torch', 'fastapi', 'starlette'})\n"
        "assert not bad, bad\n"
        "print(c.Catalog.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=WORKLOADS.parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Catalog"


# ---------------------------------------------------------------- engine mapping


def test_llm_config_for_s3_streams_and_scales() -> None:
    catalog = Catalog.model_validate(
        {
            "models": [
                entry(
                    accelerator_type="L4",
                    tensor_parallel_size=2,
                    quantization="fp8",
                    engine_overrides={"enable_prefix_caching": True},
                    autoscaling={"min_replicas": 0, "max_replicas": 3, "initial_replicas": 1},
                )
            ],
            "limits": {"max_tokens": 1000},
        }
    )
    config = llm_config_kwargs(catalog.models[0], catalog)
    assert config["model_loading_config"] == {"model_id": "m", "model_source": "s3://models-bucket/llama"}
    engine = config["engine_kwargs"]
    assert engine["load_format"] == S3_LOAD_FORMAT
    assert engine["tensor_parallel_size"] == 2 and engine["pipeline_parallel_size"] == 1
    assert engine["max_model_len"] == 4096 and engine["quantization"] == "fp8"
    assert engine["enable_prefix_caching"] is True
    assert engine["override_generation_config"] == {"max_new_tokens": 1000}
    assert config["accelerator_type"] == "L4" and "accelerator_config" not in config
    deployment = config["deployment_config"]
    assert deployment["max_ongoing_requests"] == 64
    assert deployment["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 3,
        "initial_replicas": 1,
        "target_ongoing_requests": 16,
        "upscale_delay_s": 30,
        "downscale_delay_s": 600,
    }
    assert config["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"


def test_llm_config_on_cpu_for_local_weights() -> None:
    catalog = Catalog.model_validate({"models": [entry(source="/models/tiny")]})
    config = llm_config_kwargs(catalog.models[0], catalog)
    assert config["accelerator_config"] == {"kind": "cpu"}
    assert "load_format" not in config["engine_kwargs"]
    assert "accelerator_type" not in config


def test_llm_config_for_allowed_hub_download_uses_the_cache() -> None:
    catalog = Catalog.model_validate(
        {"models": [entry(source="org/name")], "allow_hub_download": True, "model_cache_dir": "/cache"}
    )
    config = llm_config_kwargs(catalog.models[0], catalog)
    assert config["engine_kwargs"]["download_dir"] == "/cache"
    assert config["runtime_env"]["env_vars"] == {"HF_HOME": "/cache"}


# ---------------------------------------------------------------- API keys


def test_keys_from_file_win_over_env(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n\n key-one \nkey-two\n")
    keys = ApiKeys(str(keys_file), "K", environ={"K": "env-key"})
    assert keys.source == "file" and len(keys) == 2
    assert keys.verify("key-one") and keys.verify("key-two")
    assert not keys.verify("env-key") and not keys.verify("") and not keys.verify(None)
    assert not keys.verify("key-one ") and not keys.verify("KEY-ONE")


def test_keys_fall_back_to_env_and_fail_closed(tmp_path: Path) -> None:
    keys = ApiKeys(str(tmp_path / "absent"), "K", environ={"K": "a, b ,,"})
    assert keys.source == "env" and keys.verify("a") and keys.verify("b") and not keys.verify(",")
    none = ApiKeys(None, "K", environ={})
    assert none.source == "none" and len(none) == 0 and not none.verify("anything")


def test_keys_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("old\n")
    keys = ApiKeys(str(keys_file), "K", reload_interval_s=0, environ={})
    assert keys.verify("old")
    keys_file.write_text("new\n")
    os.utime(keys_file, (1_000_000_000, 1_000_000_000))
    assert keys.verify("new") and not keys.verify("old")


def test_keys_do_not_appear_in_repr_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    keys_file = tmp_path / "keys"
    keys_file.write_text("very-secret-key\n")
    keys = ApiKeys(str(keys_file), "K", environ={})
    keys.verify("very-secret-key")
    keys.verify("wrong-secret")
    assert "very-secret-key" not in caplog.text and "wrong-secret" not in caplog.text
    assert "very-secret-key" not in repr(vars(keys))


@pytest.mark.parametrize(
    ("header", "token"),
    [(b"Bearer abc", "abc"), (b"bearer  abc ", "abc"), (b"Basic abc", None), (b"Bearer", None), (None, None)],
)
def test_bearer_token(header: bytes | None, token: str | None) -> None:
    headers = [(b"authorization", header)] if header is not None else []
    assert bearer_token({"headers": headers}) == token


# ---------------------------------------------------------------- the guard middleware


class Recorder:
    """A downstream ASGI app that records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope.get("path", ""), body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(
    guard: ApiGuard, path: str, *, key: str | None = "k1", body: Any = None, method: str = "POST", chunks: int = 1
) -> tuple[int, dict[str, Any] | None]:
    raw = json.dumps(body).encode() if body is not None else b""
    parts = [raw[i::chunks] for i in range(chunks)] if chunks == 1 else [raw[: len(raw) // 2], raw[len(raw) // 2 :]]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "root_path": ""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(payload) if payload and payload != b"ok" else None)


def make_guard(counter: Any = None, **limits: int) -> tuple[ApiGuard, Recorder]:
    downstream = Recorder()
    keys = ApiKeys(None, "K", environ={"K": "k1,k2"})
    guard = ApiGuard(downstream, keys=keys, limits=RequestLimits(**limits), count_prompt_tokens=counter)
    return guard, downstream


@pytest.mark.parametrize("key", [None, "", "nope", "k1k2"])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_guard_refuses_bad_keys(key: str | None, path: str) -> None:
    guard, downstream = make_guard()
    status, body = call(guard, path, key=key, body={"prompt": "x"})
    assert status == 401
    assert body is not None and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key"
    assert downstream.calls == []


@pytest.mark.parametrize("path", ["/-/healthz", "/-/routes", "/health", "/ping"])
def test_guard_leaves_health_routes_open(path: str) -> None:
    guard, downstream = make_guard()
    assert call(guard, path, key=None, method="GET")[0] == 200
    assert downstream.calls == [(path, b"")]


def test_guard_passes_good_requests_with_the_body_intact() -> None:
    guard, downstream = make_guard(max_tokens=100)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    assert call(guard, "/v1/chat/completions", key="k2", body=body, chunks=2)[0] == 200
    assert json.loads(downstream.calls[0][1]) == body
    assert call(guard, "/v1/models", method="GET")[0] == 200


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_guard_refuses_too_many_output_tokens(param: str) -> None:
    guard, downstream = make_guard(max_tokens=100)
    status, body = call(guard, "/v1/chat/completions", body={"messages": [], param: 101})
    assert status == 400 and body is not None
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert downstream.calls == []


def test_guard_leaves_malformed_bodies_to_the_route() -> None:
    guard, downstream = make_guard(max_tokens=100)
    assert call(guard, "/v1/completions", body={"prompt": "x", "max_tokens": "many"})[0] == 200
    assert call(guard, "/v1/completions", body=["not", "an", "object"])[0] == 200
    assert len(downstream.calls) == 2


def test_guard_checks_token_id_prompts_exactly() -> None:
    guard, _ = make_guard(max_prompt_tokens=10)
    assert call(guard, "/v1/completions", body={"prompt": list(range(10))})[0] == 200
    status, body = call(guard, "/v1/completions", body={"prompt": list(range(11))})
    assert status == 400 and body is not None and body["error"]["code"] == "context_length_exceeded"
    assert call(guard, "/v1/completions", body={"prompt": [[1] * 3, [1] * 11]})[0] == 400


def test_guard_counts_exactly_only_above_the_cheap_bound() -> None:
    counted: list[str] = []

    async def counter(path: str, body: dict[str, Any]) -> int:
        counted.append(path)
        return len(body["prompt"].split())

    guard, _ = make_guard(counter, max_prompt_tokens=50)
    assert call(guard, "/v1/completions", body={"prompt": "a b c"})[0] == 200
    assert counted == []  # 5 bytes: within the bound, no count needed
    assert call(guard, "/v1/completions", body={"prompt": "word " * 40})[0] == 200
    assert call(guard, "/v1/completions", body={"prompt": "word " * 60})[0] == 400
    assert counted == ["/v1/completions", "/v1/completions"]


def test_guard_defers_to_the_engine_when_counting_fails() -> None:
    async def broken(path: str, body: dict[str, Any]) -> int:
        raise RuntimeError("engine unavailable")

    guard, downstream = make_guard(broken, max_prompt_tokens=5)
    assert call(guard, "/v1/completions", body={"prompt": "word " * 60})[0] == 200
    assert len(downstream.calls) == 1


def test_guard_refuses_huge_bodies() -> None:
    downstream = Recorder()
    guard = ApiGuard(
        downstream, keys=ApiKeys(None, "K", environ={"K": "k1"}), limits=RequestLimits(), max_body_bytes=100
    )
    assert call(guard, "/v1/completions", body={"prompt": "x" * 200})[0] == 413
    assert downstream.calls == []


def test_prompt_bound_is_an_upper_bound_for_chat() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo"}]}], "tools": [{"a": 1}]}
    bound = prompt_token_bound("/v1/chat/completions", body)
    assert bound is not None
    tokens, exact = bound
    assert not exact and tokens >= len("héllo".encode()) + len("user")
    assert prompt_token_bound("/v1/embeddings", body) is None
