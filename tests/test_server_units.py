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
from inference_server.guard import (
    MIN_BODY_BYTES,
    ApiKeys,
    PromptSize,
    bearer_token,
    body_cap,
    openai_error,
    parse_json_object,
    prompt_sizes,
)
from pydantic import ValidationError

from tests.guard_calls import CHAT, Recorder, call, make_guard

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def entry(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model_id": "m", "source": "s3://models-bucket/llama", "max_model_len": 4096}
    base.update(overrides)
    return base


# ---------------------------------------------------------------- catalogue


def test_catalog_defaults_match_the_contract() -> None:
    catalog = Catalog.model_validate({"models": [entry()]})
    assert catalog.limits == RequestLimits(max_tokens=4096, max_prompt_tokens=32768)
    assert (catalog.limits.max_n, catalog.limits.max_request_output_tokens) == (4, None)
    assert catalog.limits.prompt_bytes_per_token == 16
    assert catalog.limits.output_token_budget == 4096 * 4
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


# ---------------------------------------------------------------- new limits in the catalogue


def test_output_budget_defaults_to_max_tokens_times_max_n() -> None:
    assert RequestLimits(max_tokens=100, max_n=3).output_token_budget == 300
    assert RequestLimits(max_tokens=100, max_request_output_tokens=150).output_token_budget == 150


@pytest.mark.parametrize(
    "bad",
    [
        {"max_n": 0},
        {"max_n": 1000},
        {"max_tokens": 100, "max_request_output_tokens": 99},
        {"prompt_bytes_per_token": 0},
        {"max_request_output_tokens": 0},
    ],
)
def test_request_limits_reject(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RequestLimits.model_validate(bad)


def test_body_cap_is_derived_from_the_prompt_limit_with_a_floor() -> None:
    # The defaults: 32768 tokens x 16 bytes x 2 (JSON escaping) is exactly the 1 MiB floor.
    assert body_cap(RequestLimits()) == MIN_BODY_BYTES == 1024 * 1024
    assert body_cap(RequestLimits(max_prompt_tokens=200)) == MIN_BODY_BYTES
    assert body_cap(RequestLimits(max_prompt_tokens=131072)) == 131072 * 16 * 2
    assert body_cap(RequestLimits(max_prompt_tokens=131072, prompt_bytes_per_token=8)) == 131072 * 8 * 2


# ---------------------------------------------------------------- the guard middleware


def assert_no_internals(error: dict[str, Any]) -> None:
    text = json.dumps(error).lower()
    for word in ("traceback", "exception", "internal", "serializable", "object of type", "ray.llm", "vllm"):
        assert word not in text, error


@pytest.mark.parametrize("key", [None, "", "nope", "k1k2"])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_guard_refuses_bad_keys(key: str | None, path: str) -> None:
    guard, downstream = make_guard()
    answer = call(guard, path, key=key, body={"prompt": "x"})
    assert answer.status == 401 and answer.error["code"] == "invalid_api_key"
    assert downstream.calls == []


@pytest.mark.parametrize("path", ["/-/healthz", "/-/routes", "/health", "/ping"])
def test_guard_leaves_health_routes_open(path: str) -> None:
    guard, downstream = make_guard()
    assert call(guard, path, key=None, method="GET", content_type=None).status == 200
    assert downstream.calls == [(path, b"")]


def test_options_needs_a_key_too() -> None:
    guard, downstream = make_guard()
    answer = call(guard, "/v1/chat/completions", key=None, method="OPTIONS", content_type=None)
    assert answer.status == 401 and answer.error["code"] == "invalid_api_key"
    assert downstream.calls == []
    assert call(guard, "/v1/chat/completions", method="OPTIONS", content_type=None).status == 200
    assert len(downstream.calls) == 1


@pytest.mark.parametrize("key", [None, "k1"])
def test_websockets_are_refused_with_or_without_a_key(key: str | None) -> None:
    guard, downstream = make_guard()
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": headers, "root_path": ""}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    assert [m["type"] for m in sent] == ["websocket.close"] and sent[0]["code"] == 1008
    assert downstream.calls == []


def test_guard_passes_good_requests_with_the_body_intact() -> None:
    guard, downstream = make_guard(max_tokens=100)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    raw = json.dumps(body).encode()
    answer = call(guard, "/v1/chat/completions", key="k2", raw=raw, chunks=[raw[:10], raw[10:]])
    assert answer.status == 200 and answer.raw == b"ok"
    assert json.loads(downstream.calls[0][1]) == body
    assert call(guard, "/v1/models", method="GET", content_type=None).status == 200


@pytest.mark.parametrize(
    ("content_type", "headers"),
    [
        ("text/plain", ()),
        ("application/x-www-form-urlencoded", ()),
        (None, ()),
        ("multipart/form-data; boundary=x", ()),
        ("application/json; charset=latin-1", ()),
        ("application/jsonx", ()),
        ("application/json", ((b"content-encoding", b"gzip"),)),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize"])
def test_a_body_that_is_not_declared_json_gets_415(
    content_type: str | None, headers: tuple[tuple[bytes, bytes], ...], path: str
) -> None:
    guard, downstream = make_guard()
    answer = call(guard, path, body=CHAT, content_type=content_type, headers=headers, forbid_reading=True)
    assert answer.status == 415, answer.raw
    assert answer.error["code"] == "unsupported_media_type" and answer.error["type"] == "invalid_request_error"
    assert "application/json" in answer.error["message"] or "Content-Encoding" in answer.error["message"]
    assert downstream.calls == []


@pytest.mark.parametrize("content_type", ["application/json; charset=UTF-8", "Application/JSON", "application/json;"])
def test_json_content_types_with_parameters_pass(content_type: str) -> None:
    guard, downstream = make_guard()
    assert call(guard, "/v1/chat/completions", body=CHAT, content_type=content_type).status == 200
    assert len(downstream.calls) == 1


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "x", "temperature": NaN}',
        b'{"model": "m", "prompt": "x", "temperature": Infinity}',
        b'{"model": "m", "prompt": "x", "temperature": -Infinity}',
        b'{"model": "m", "prompt": "x", "temperature": 1e999}',
        b'{"model": "m", "prompt": "x"',
        b"model=m&prompt=x",
        b"",
        b"   ",
        b'["not", "an", "object"]',
        b'"a string"',
        b"\xff\xfe{}",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "m", "prompt": "a\\udc00"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\uD83D x"}]}',
    ],
    ids=[
        "nan",
        "infinity",
        "minus-infinity",
        "overflow",
        "truncated",
        "form",
        "empty",
        "blank",
        "array",
        "string",
        "not-utf8",
        "deep",
        "huge-int",
        "lone-low-surrogate",
        "lone-high-surrogate",
    ],
)
def test_bodies_that_are_not_a_json_object_get_400(raw: bytes) -> None:
    guard, downstream = make_guard()
    answer = call(guard, "/v1/completions", raw=raw)
    assert answer.status == 400, answer.raw
    error = answer.error
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert_no_internals(error)
    assert downstream.calls == []


def test_parse_json_object_returns_the_object() -> None:
    assert parse_json_object(b'{"a": [1, 2.5, "\\u00e9"]}') == {"a": [1, 2.5, "é"]}
    # A complete pair is one character; an escaped backslash before "ud800" is plain text.
    assert parse_json_object(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}


def test_a_declared_length_over_the_cap_gets_413_before_reading() -> None:
    guard, downstream = make_guard()
    huge = str(64 * 1024 * 1024).encode()
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/nothing")):
        answer = call(
            guard,
            path,
            method=method,
            raw=b"{}",
            content_length=False,
            headers=((b"content-length", huge),),
            forbid_reading=True,
        )
        assert answer.status == 413 and answer.error["code"] == "request_too_large"
    # Even without a key: refusing costs nothing and tells nothing.
    answer = call(guard, "/v1/completions", key=None, content_length=False, headers=((b"content-length", huge),))
    assert answer.status == 413
    assert downstream.calls == []


def test_a_malformed_content_length_gets_400() -> None:
    guard, _ = make_guard()
    answer = call(guard, "/v1/completions", content_length=False, headers=((b"content-length", b"-5"),))
    assert answer.status == 400 and answer.error["code"] == "invalid_content_length"


def test_a_chunked_body_is_cut_off_at_the_cap_while_it_streams() -> None:
    guard, downstream = make_guard()
    cap = body_cap(RequestLimits())
    piece = b" " * (cap // 3)
    chunks = [b'{"prompt": "'] + [piece] * 10 + [b'"}']
    answer = call(guard, "/v1/completions", chunks=chunks)
    assert answer.status == 413 and answer.error["code"] == "request_too_large"
    assert answer.receives == 4  # stopped at the chunk that passed the cap, not at the end
    assert downstream.calls == []


def test_a_streamed_body_under_the_cap_passes() -> None:
    guard, downstream = make_guard()
    raw = json.dumps({"model": "m", "prompt": "hello"}).encode()
    assert call(guard, "/v1/completions", chunks=[raw[:5], raw[5:9], raw[9:]]).status == 200
    assert json.loads(downstream.calls[0][1])["prompt"] == "hello"


def test_a_body_on_a_passed_through_route_is_capped_too() -> None:
    guard, downstream = make_guard()
    cap = body_cap(RequestLimits())
    answer = call(guard, "/v1/models", method="GET", content_type=None, chunks=[b" " * cap, b" " * 10])
    assert answer.status == 200 and downstream.disconnected


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"])
def test_an_unknown_model_gets_an_openai_404(path: str) -> None:
    guard, downstream = make_guard()
    answer = call(guard, path, body={**CHAT, "prompt": "x", "model": "gpt-5"})
    assert answer.status == 404
    error = answer.error
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "gpt-5" in error["message"]
    assert downstream.calls == []
    assert call(guard, path, body={**CHAT, "model": 7}).status == 400


def test_known_or_missing_models_pass() -> None:
    guard, downstream = make_guard()
    assert call(guard, "/v1/chat/completions", body={**CHAT, "model": "org/name"}).status == 200
    assert call(guard, "/v1/chat/completions", body={"messages": CHAT["messages"]}).status == 200
    assert len(downstream.calls) == 2


def test_an_unknown_model_by_path_gets_an_openai_404() -> None:
    guard, downstream = make_guard()
    answer = call(guard, "/v1/models/gpt-5", method="GET", content_type=None)
    assert answer.status == 404 and answer.error["code"] == "model_not_found"
    assert call(guard, "/v1/models/m", method="GET", content_type=None).status == 200
    assert call(guard, "/v1/models/org--name", method="GET", content_type=None).status == 200
    assert len(downstream.calls) == 2


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens", "min_tokens", "n"])
@pytest.mark.parametrize("value", ["100000", "3", 100000.0, 2.0, True, [1], {"a": 1}])
def test_integer_parameters_must_be_json_integers(param: str, value: Any) -> None:
    guard, downstream = make_guard(max_tokens=100)
    answer = call(guard, "/v1/chat/completions", body={**CHAT, param: value})
    assert answer.status == 400
    error = answer.error
    assert (error["param"], error["code"]) == (param, "invalid_type")
    assert "must be an integer" in error["message"]
    assert downstream.calls == []


def test_null_integer_parameters_mean_the_default() -> None:
    guard, _ = make_guard()
    body = {"model": "m", "prompt": "x", "max_tokens": None, "n": None}
    assert call(guard, "/v1/completions", body=body).status == 200


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_guard_refuses_too_many_output_tokens(param: str) -> None:
    guard, downstream = make_guard(max_tokens=100)
    answer = call(guard, "/v1/chat/completions", body={**CHAT, param: 101})
    assert answer.status == 400
    assert (answer.error["param"], answer.error["code"]) == (param, "max_tokens_exceeded")
    assert downstream.calls == []


@pytest.mark.parametrize("param", ["n"])
def test_choices_are_capped(param: str) -> None:
    guard, downstream = make_guard(max_tokens=64, max_n=4)
    answer = call(guard, "/v1/completions", body={"model": "m", "prompt": "x", "max_tokens": 8, param: 64})
    assert answer.status == 400
    assert (answer.error["param"], answer.error["code"]) == (param, "too_many_choices")
    assert call(guard, "/v1/completions", body={"model": "m", "prompt": "x", "max_tokens": 8, param: 4}).status == 200
    assert len(downstream.calls) == 1


def test_the_whole_request_output_is_bounded() -> None:
    guard, downstream = make_guard(max_tokens=100, max_n=4, max_request_output_tokens=200)
    # n x max_tokens, with the server's max_tokens charged when the request leaves it out.
    assert call(guard, "/v1/chat/completions", body={**CHAT, "n": 3}).status == 400
    assert call(guard, "/v1/chat/completions", body={**CHAT, "n": 3, "max_tokens": 67}).status == 400
    assert call(guard, "/v1/chat/completions", body={**CHAT, "n": 3, "max_tokens": 66}).status == 200
    assert call(guard, "/v1/chat/completions", body={**CHAT, "n": 2}).status == 200
    # Several prompts count as several sequences; token ids are one prompt.
    many = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 67}
    answer = call(guard, "/v1/completions", body=many)
    assert answer.status == 400 and answer.error["code"] == "output_tokens_exceeded"
    assert "3 prompts" in answer.error["message"]
    assert call(guard, "/v1/completions", body={**many, "prompt": [[1], [2], [3]]}).status == 400
    assert call(guard, "/v1/completions", body={**many, "prompt": [1, 2, 3]}).status == 200
    assert len(downstream.calls) == 3


def test_the_default_budget_is_max_tokens_times_max_n() -> None:
    guard, _ = make_guard(max_tokens=64, max_n=4)
    assert call(guard, "/v1/completions", body={"model": "m", "prompt": ["a"] * 5, "max_tokens": 64}).status == 400
    assert call(guard, "/v1/completions", body={"model": "m", "prompt": ["a"] * 4, "max_tokens": 64}).status == 200


def test_guard_checks_token_id_prompts_exactly() -> None:
    guard, _ = make_guard(max_prompt_tokens=10, max_request_prompt_tokens=20)
    assert call(guard, "/v1/completions", body={"prompt": list(range(10))}).status == 200
    answer = call(guard, "/v1/completions", body={"prompt": list(range(11))})
    assert answer.status == 400 and answer.error["code"] == "context_length_exceeded"
    assert answer.error["param"] == "prompt"
    assert call(guard, "/v1/completions", body={"prompt": [[1] * 3, [1] * 11]}).status == 400
    assert call(guard, "/v1/completions", body={"prompt": [[1] * 3, [1] * 10]}).status == 200


@pytest.mark.parametrize(
    "prompt",
    [[], [[]], [1, "a"], [1.0, 2], [True, 1], [[1], "a"], [[1], [1.5]], [["a"]], {"text": "x"}, 7],
    ids=["empty", "empty-inner", "mixed", "floats", "bools", "list-and-str", "inner-float", "inner-str", "obj", "int"],
)
def test_malformed_prompts_get_400(prompt: Any) -> None:
    guard, downstream = make_guard()
    answer = call(guard, "/v1/completions", body={"model": "m", "prompt": prompt})
    assert answer.status == 400 and answer.error["code"] == "invalid_prompt" and answer.error["param"] == "prompt"
    assert downstream.calls == []


def test_prompt_sizes() -> None:
    assert prompt_sizes("/v1/completions", {"prompt": "héllo"}) == [PromptSize(6, 8, False)]
    assert prompt_sizes("/v1/completions", {"prompt": [[1, 2], [3]]}) == [
        PromptSize(0, 2, True),
        PromptSize(0, 1, True),
    ]
    assert prompt_sizes("/v1/completions", {}) is None
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo"}]}], "tools": [{"a": 1}]}
    (size,) = prompt_sizes("/v1/chat/completions", chat) or []
    assert isinstance(size, PromptSize) and not size.exact
    assert size.text_bytes == len("héllo".encode()) + len("user") + len(json.dumps([{"a": 1}]))
    assert size.tokens > size.text_bytes
    assert prompt_sizes("/v1/chat/completions", {"messages": "hi"}) is None
    assert prompt_sizes("/v1/embeddings", chat) is None


def test_guard_counts_exactly_only_between_the_cheap_bounds() -> None:
    counted: list[str] = []

    async def counter(path: str, body: dict[str, Any]) -> list[int]:
        counted.append(path)
        text = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        return [len(text.split())]

    guard, _ = make_guard(counter, max_prompt_tokens=50, prompt_bytes_per_token=8)
    assert call(guard, "/v1/completions", body={"prompt": "a b c"}).status == 200
    assert counted == []  # 5 bytes: within the bound, no count needed
    assert call(guard, "/v1/completions", body={"prompt": "word " * 40}).status == 200
    assert call(guard, "/v1/completions", body={"prompt": "word " * 60}).status == 400
    assert counted == ["/v1/completions", "/v1/completions"]
    # Over 50 tokens x 8 bytes: refused without asking the tokenizer.
    answer = call(guard, "/v1/completions", body={"prompt": "w" * 401})
    assert answer.status == 400 and answer.error["code"] == "context_length_exceeded"
    assert "bytes" in answer.error["message"]
    chat = {"messages": [{"role": "user", "content": "w" * 401}]}
    answer = call(guard, "/v1/chat/completions", body=chat)
    assert answer.status == 400 and answer.error["param"] == "messages"
    assert call(guard, "/v1/completions", body={"prompt": ["a", "w" * 401]}).status == 400
    assert len(counted) == 2


def test_a_prompt_that_can_not_be_counted_is_not_served() -> None:
    # An uncounted prompt is the bypass the limits close: 503 when the engine
    # could not count it, 400 when its tokenizer refused the prompt.
    async def broken(path: str, body: dict[str, Any]) -> list[int]:
        raise RuntimeError("engine unavailable")

    async def refusing(path: str, body: dict[str, Any]) -> list[int] | None:
        return None

    guard, downstream = make_guard(broken, max_prompt_tokens=5)
    answer = call(guard, "/v1/completions", body={"prompt": "word " * 10})
    assert answer.status == 503 and answer.error["code"] == "prompt_not_measured"
    assert answer.error["type"] == "server_error"
    guard, downstream = make_guard(refusing, max_prompt_tokens=5)
    answer = call(guard, "/v1/completions", body={"prompt": "word " * 10})
    assert answer.status == 400 and answer.error["code"] == "invalid_prompt"
    assert downstream.calls == []


def test_other_routes_and_methods_pass_through() -> None:
    guard, downstream = make_guard()
    assert call(guard, "/v1/embeddings", body={"model": "m", "input": ["x"] * 100}).status == 200
    assert call(guard, "/detokenize", body={"model": "m", "tokens": [1, 2]}).status == 200
    assert call(guard, "/v1/whatever", method="GET", content_type=None).status == 200
    assert len(downstream.calls) == 3


# ---------------------------------------------------------------- errors from the routes, reshaped

RAY_500 = {
    "error": {
        "message": "Message: Internal Server Error (Request ID: 3f2a-11), Internal exception: Internal Server "
        "Error (Request ID: 3f2a-11), original exception: Object of type bytes is not JSON serializable",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
RAY_400 = {
    "error": {
        "message": "Message: temperature must be a finite number. (Request ID: ab-12), Internal exception: "
        "ray.llm._internal.serve.core.configs.openai_api_models.OpenAIHTTPException (Request ID: ab-12), "
        "original exception: ",
        "type": "OpenAIHTTPException",
        "param": None,
        "code": 400,
    }
}
RAY_VALIDATION = {
    "error": {
        "message": "Invalid request format: Input should be a valid list at ('body', 'messages')",
        "type": "list_type",
        "param": "hi there",
        "code": "invalid_parameter",
    }
}
VLLM_404 = {
    "error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
}


SERVER_FAULT = "The server had an error while processing your request."
RETRY_LATER = "The server is overloaded or not ready yet. Please retry your request."
INVALID = "invalid_request_error"
VLLM_PARAM = {"error": {"message": "bad", "type": "x", "param": "body.messages", "code": 400}}
TRACEBACK = b"upstream: Traceback (most recent call last) KeyError"
RESHAPED = {
    "ray-500": (500, RAY_500, (f"{SERVER_FAULT} (Request ID: 3f2a-11)", "server_error", None, None)),
    "ray-400": (400, RAY_400, ("temperature must be a finite number. (Request ID: ab-12)", INVALID, None, None)),
    "ray-validation": (
        400,
        RAY_VALIDATION,
        (RAY_VALIDATION["error"]["message"], INVALID, "messages", "invalid_parameter"),
    ),
    "fastapi-404": (404, {"detail": "Not Found"}, ("Not Found", INVALID, None, "not_found")),
    "fastapi-405": (405, {"detail": "Method Not Allowed"}, ("Method Not Allowed", INVALID, None, "method_not_allowed")),
    "vllm-404": (404, VLLM_404, ("The model `x` does not exist.", INVALID, "model", "not_found")),
    "vllm-param": (400, VLLM_PARAM, ("bad", INVALID, "messages", None)),
    "text-503": (503, TRACEBACK, (RETRY_LATER, "server_error", None, None)),
    "empty-422": (422, b"", ("The request failed with HTTP 422.", INVALID, None, None)),
}


@pytest.mark.parametrize(("status", "raw", "expected"), list(RESHAPED.values()), ids=list(RESHAPED))
def test_route_errors_are_reshaped(status: int, raw: Any, expected: tuple[str, str, str | None, str | None]) -> None:
    body = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    downstream = Recorder(status=status, body=body, chunks=2)
    guard, _ = make_guard(downstream=downstream)
    answer = call(guard, "/v1/chat/completions", body=CHAT)
    assert answer.status == status
    error = answer.error
    assert (error["message"], error["type"], error["param"], error["code"]) == expected
    assert answer.headers[b"x-request-id"] == b"rid-1"  # other headers stay
    if status >= 500:
        assert_no_internals(error)
    assert openai_error(status, body) == answer.raw


def test_successful_and_head_answers_are_left_alone() -> None:
    guard, _ = make_guard(downstream=Recorder(status=200, body=b"data: 1\n\ndata: 2\n\n", chunks=3))
    assert call(guard, "/v1/chat/completions", body=CHAT).raw == b"data: 1\n\ndata: 2\n\n"
    guard, _ = make_guard(downstream=Recorder(status=404, body=b"", chunks=1))
    answer = call(guard, "/v1/models", method="HEAD", content_type=None)
    assert answer.status == 404 and answer.raw == b""


def test_a_huge_error_body_passes_unchanged() -> None:
    big = b"x" * (200 * 1024)
    guard, _ = make_guard(downstream=Recorder(status=400, body=big, chunks=8))
    answer = call(guard, "/v1/chat/completions", body=CHAT)
    assert answer.status == 400 and answer.raw == big
