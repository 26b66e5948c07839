"""The request policy through the guard: every field, message field and content part it refuses, every bound.

Each refusal is sent through :class:`ApiGuard` (or the vllm-server layout's
guard) as a client would send it, and must be answered with an OpenAI-style
400 naming the field before the route behind the guard sees the request.
Before the allow-list, every one of these reached vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from inference_server.catalog import Catalog, ModelEntry, RequestLimits
from inference_server.engine import engine_kwargs
from inference_server.request_policy import (
    ALLOWED_FIELDS,
    CHAT_PATH,
    COMPLETIONS_PATH,
    ROUTER_ONLY_FIELDS,
    ROUTER_VALUES,
    redact_model_cards,
    wants_prompt_logprobs,
)
from inference_server.vllm_guard import SETTINGS_ENV, VllmServerGuard
from pydantic import ValidationError

from tests.guard_calls import CHAT, Answer, Downstream, FakeTokenization, Recorder, call, make_guard, send_to

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 4}


def refused(answer: Answer, param: str, code: str) -> dict[str, Any]:
    assert answer.status == 400, (answer.status, answer.raw[:300])
    error = answer.error
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error"
    return error


# ---------------------------------------------------------------- top-level fields


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("kv_transfer_params", {"prompt_token_ids": [1] * 300, "do_remote_prefill": False}, "never see"),
        ("ec_transfer_params", {"x": 1}, "never see"),
        ("priority", -100, "scheduling priority"),
        ("vllm_xargs", {"a": 1}, "engine plugins"),
        ("prompt_embeds", "AAAA", "bypass"),
        ("best_of", 2, "use n"),
        ("suffix", "x", "does not implement"),
        ("use_beam_search", True, "beam search"),
        ("truncate_prompt_tokens", 5, "send the prompt"),
        ("request_id", "mine", "assigns request ids"),
        ("cache_salt", "x", None),
        ("bad_words", ["x"] * 1000, None),
        ("max_completion_tokens", 4, None),  # a chat field
        ("frobnicate", 1, None),
    ],
)
def test_completions_refuse_fields_outside_the_allow_list(field: str, value: Any, reason: str | None) -> None:
    guard, downstream = make_guard()
    error = refused(call(guard, COMPLETIONS_PATH, body={**COMPLETION, field: value}), field, "unsupported_parameter")
    assert field in error["message"]
    if reason:
        assert reason in error["message"]
    else:
        assert error["message"].startswith("Unrecognized request argument supplied")
    assert downstream.calls == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_transfer_params", {"prompt_token_ids": [1] * 300}),
        ("documents", [{"title": "t", "text": "w " * 500}]),
        ("chat_template_kwargs", {"extra": "w " * 500}),
        ("chat_template", "{{ 'x' * 100000 }}"),
        ("reasoning_effort", "high"),
        ("priority", 5),
        ("vllm_xargs", {"a": 1}),
        ("structured_outputs", {"regex": "a+"}),
        ("mm_processor_kwargs", {}),
        ("media_io_kwargs", {}),
        ("thinking_token_budget", 10),
        ("add_special_tokens", True),
        ("echo_prompt", True),
    ],
)
def test_chat_refuses_fields_outside_the_allow_list(field: str, value: Any) -> None:
    guard, downstream = make_guard()
    error = refused(call(guard, CHAT_PATH, body={**CHAT, field: value}), field, "unsupported_parameter")
    assert field in error["message"]
    assert downstream.calls == []


def test_the_allow_list_is_vllms_own_fields() -> None:
    # Every accepted field is one vLLM 0.29's request model defines: none is
    # dropped silently by its extra="allow".
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert ALLOWED_FIELDS[CHAT_PATH] <= set(ChatCompletionRequest.model_fields)
    assert ALLOWED_FIELDS[COMPLETIONS_PATH] <= set(CompletionRequest.model_fields)


def test_ordinary_openai_requests_pass_unchanged() -> None:
    guard, downstream = make_guard(max_tokens=64)
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "ops"},
            {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Paris"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "weather", "description": "d", "parameters": {"type": "object"}, "strict": True},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "logprobs": True,
        "top_logprobs": 5,
        "max_completion_tokens": 16,
        "temperature": 0.2,
        "top_p": 0.9,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logit_bias": {"5": 1.0},
        "seed": 7,
        "stop": ["\n"],
        "user": "u",
        "n": 2,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "return_token_ids": True,
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
    assert call(guard, CHAT_PATH, body=chat).status == 200
    completion = {**COMPLETION, "echo": True, "logprobs": 5, "n": 2, "stream": False, "prompt": ["a", "b"]}
    assert call(guard, COMPLETIONS_PATH, body=completion).status == 200
    assert [json.loads(body) for _, body in downstream.calls] == [chat, completion]


# ---------------------------------------------------------------- the router's own fields

# What vllm-router 0.1.17 adds to every body it forwards (tests/test_router_bodies.py runs it).
ROUTER_CHAT = {
    "include_reasoning": True,
    "no_stop_trim": False,
    "return_hidden_states": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
}
ROUTER_COMPLETION = {"no_stop_trim": False, "return_hidden_states": False}
# The ones vLLM 0.29 does not define: the guard removes them.
NOT_VLLMS = {"no_stop_trim", "return_hidden_states", "separate_reasoning", "stream_reasoning"}
ROUTER_FIELDS = [(CHAT_PATH, f, v) for f, v in ROUTER_CHAT.items()] + [
    (COMPLETIONS_PATH, f, v) for f, v in ROUTER_COMPLETION.items()
]


class LengthRecorder(Recorder):
    """A :class:`Recorder` that also keeps the ``Content-Length`` each request reached it with."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.lengths.append(int(dict(scope["headers"])[b"content-length"]))
        await super().__call__(scope, receive, send)


@pytest.mark.parametrize(("path", "field", "value"), ROUTER_FIELDS)
def test_each_router_field_passes_at_the_routers_value_and_vllm_gets_only_its_own_fields(
    path: str, field: str, value: bool
) -> None:
    downstream = LengthRecorder()
    guard, _ = make_guard(downstream=downstream)
    base = CHAT if path == CHAT_PATH else COMPLETION
    assert call(guard, path, body={**base, field: value}).status == 200
    ((_, passed_on),) = downstream.calls
    assert json.loads(passed_on) == (base if field in NOT_VLLMS else {**base, field: value})
    assert downstream.lengths == [len(passed_on)]


def test_every_router_field_at_once_and_the_rest_of_the_body_unchanged() -> None:
    downstream = LengthRecorder()
    guard, _ = make_guard(downstream=downstream)
    # Text JSON escapes, a character outside the BMP (a surrogate pair in the body),
    # floats and integers: what vLLM parses is what the client sent, less the router's own fields.
    chat = {
        **CHAT,
        "messages": [{"role": "user", "content": 'caf\u00e9 \U0001f600 "quoted"\n'}],
        "user": "\U0001f600",
        "temperature": 0.1,
        "seed": 2**62,
        "logit_bias": {"5": -1.5e-7},
    }
    raw = json.dumps({**chat, **ROUTER_CHAT}).encode()
    assert call(guard, CHAT_PATH, raw=raw).status == 200
    ((_, passed_on),) = downstream.calls
    assert json.loads(passed_on) == {**chat, "include_reasoning": True}
    assert downstream.lengths == [len(passed_on)]
    # Without a field to remove, the very bytes the client sent.
    raw = json.dumps({**COMPLETION, "stream": False, "echo": False}).encode()
    assert call(guard, COMPLETIONS_PATH, raw=raw).status == 200
    assert downstream.calls[1] == (COMPLETIONS_PATH, raw)


@pytest.mark.parametrize(("path", "field", "value"), ROUTER_FIELDS)
@pytest.mark.parametrize("other", ["opposite", "string", 0, 1, 1.0, None, [], {}])
def test_each_router_field_is_refused_at_any_other_value(path: str, field: str, value: bool, other: Any) -> None:
    if other == "opposite":
        other = not value
    elif other == "string":
        other = json.dumps(value)  # "false" or "true"
    guard, downstream = make_guard()
    base = CHAT if path == CHAT_PATH else COMPLETION
    error = refused(call(guard, path, body={**base, field: other}), field, "unsupported_value")
    assert error["message"].startswith(f"{field} is accepted only as {json.dumps(value)} by this server, not ")
    assert "\n" not in error["message"]
    assert downstream.calls == []


@pytest.mark.parametrize("field", ["include_reasoning", "separate_reasoning", "stream_reasoning"])
def test_the_routers_chat_fields_are_unknown_on_completions(field: str) -> None:
    guard, downstream = make_guard()
    error = refused(call(guard, COMPLETIONS_PATH, body={**COMPLETION, field: True}), field, "unsupported_parameter")
    assert error["message"] == f"Unrecognized request argument supplied: {field}"
    assert downstream.calls == []


def test_the_router_fields_vllm_defines_pass_at_its_defaults_and_it_defines_no_other() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for path, model, values in (
        (CHAT_PATH, ChatCompletionRequest, ROUTER_CHAT),
        (COMPLETIONS_PATH, CompletionRequest, ROUTER_COMPLETION),
    ):
        assert ROUTER_VALUES[path] == values
        for field, value in values.items():
            if field in NOT_VLLMS:
                assert field not in model.model_fields, (model.__name__, field)
            else:
                assert model.model_fields[field].default is value, (model.__name__, field)
    assert ROUTER_ONLY_FIELDS == NOT_VLLMS


# ---------------------------------------------------------------- messages and content parts


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "content": "a", "reasoning": "w " * 500}, "messages[0].reasoning"),
        ({"role": "assistant", "content": "a", "reasoning_content": "w " * 500}, "messages[0].reasoning_content"),
        ({"role": "assistant", "content": "a", "refusal": "no"}, "messages[0].refusal"),
        ({"role": "assistant", "content": "a", "function_call": {"name": "f"}}, "messages[0].function_call"),
        ({"role": "user", "content": "a", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "user", "content": "a", "documents": []}, "messages[0].documents"),
    ],
)
def test_message_fields_outside_the_allow_list_are_refused(message: dict[str, Any], param: str) -> None:
    guard, downstream = make_guard()
    body = {**CHAT, "messages": [message, {"role": "user", "content": "hi"}]}
    refused(call(guard, CHAT_PATH, body=body), param, "unsupported_parameter")
    assert downstream.calls == []


@pytest.mark.parametrize(
    "part",
    [
        {"type": "refusal", "refusal": "w " * 500},
        {"type": "thinking", "thinking": "w " * 500},
        {"type": "tool_reference", "name": "w" * 500},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://x"}},
        {"type": "input_text", "text": "x"},
        {"type": "banana"},
        {"text": "no type"},
        {"image_url": "http://x"},
    ],
    ids=lambda p: str(p.get("type", "untyped-" + next(iter(p)))),
)
def test_content_parts_other_than_text_are_refused(part: dict[str, Any]) -> None:
    guard, downstream = make_guard()
    body = {**CHAT, "messages": [{"role": "assistant", "content": [{"type": "text", "text": "a"}, part]}]}
    error = refused(call(guard, CHAT_PATH, body=body), "messages[0].content[1].type", "invalid_value")
    assert "only text content parts" in error["message"]
    assert downstream.calls == []


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "uuid": "x"}]}],
            "messages[0].content[0].uuid",
            "unsupported_parameter",
        ),
        ([{"role": "user", "content": ["a plain string"]}], "messages[0].content[0]", "invalid_value"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "invalid_value"),
        ([{"role": "user", "content": {"type": "text", "text": "a"}}], "messages[0].content", "invalid_value"),
        ([{"role": "user", "content": None}], "messages[0].content", "invalid_value"),
        ([{"role": "function", "content": "a", "name": "f"}], "messages[0].role", "invalid_value"),
        ([{"role": "root", "content": "a"}], "messages[0].role", "invalid_value"),
        ([{"content": "a"}], "messages[0].role", "invalid_value"),
        ([], "messages", "invalid_value"),
        ([{"role": "tool", "content": "a", "tool_call_id": 5}], "messages[0].tool_call_id", "invalid_value"),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}, "x": 1}]}],
            "messages[0].tool_calls[0].x",
            "unsupported_parameter",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}],
            "messages[0].tool_calls[0]",
            "invalid_value",
        ),
    ],
)
def test_message_shapes_outside_the_api_are_refused(messages: list[Any], param: str, code: str) -> None:
    guard, downstream = make_guard()
    refused(call(guard, CHAT_PATH, body={**CHAT, "messages": messages}), param, code)
    assert downstream.calls == []


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": "w" * 100}}]},
            "tools[0].function.x",
            "unsupported_parameter",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}, "defer_loading": True}]},
            "tools[0].defer_loading",
            "unsupported_parameter",
        ),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0]", "invalid_value"),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format.type", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
            "unsupported_parameter",
        ),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unsupported_parameter"),
        ({"echo": "true"}, "echo", "invalid_type"),
        ({"stream": 1}, "stream", "invalid_type"),
        ({"logprobs": 1}, "logprobs", "invalid_type"),
    ],
)
def test_chat_parameter_shapes_outside_the_api_are_refused(fields: dict[str, Any], param: str, code: str) -> None:
    guard, downstream = make_guard()
    refused(call(guard, CHAT_PATH, body={**CHAT, **fields}), param, code)
    assert downstream.calls == []


def test_a_completion_needs_a_prompt() -> None:
    guard, downstream = make_guard()
    refused(call(guard, COMPLETIONS_PATH, body={"model": "m", "max_tokens": 4}), "prompt", "invalid_prompt")
    assert downstream.calls == []


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS_PATH, {"logprobs": 6}, "logprobs"),
        (COMPLETIONS_PATH, {"logprobs": 20, "echo": True, "max_tokens": 0}, "logprobs"),
        (COMPLETIONS_PATH, {"logprobs": -1}, "logprobs"),
        (COMPLETIONS_PATH, {"prompt_logprobs": 6}, "prompt_logprobs"),
        (COMPLETIONS_PATH, {"prompt_logprobs": -1}, "prompt_logprobs"),
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 20}, "top_logprobs"),
        (CHAT_PATH, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (CHAT_PATH, {"prompt_logprobs": 6}, "prompt_logprobs"),
    ],
)
def test_logprobs_are_bounded_by_max_logprobs(path: str, fields: dict[str, Any], param: str) -> None:
    guard, downstream = make_guard()
    base = COMPLETION if path == COMPLETIONS_PATH else CHAT
    error = refused(call(guard, path, body={**base, **fields}), param, "logprobs_exceeded")
    assert "0 to 5" in error["message"]
    assert downstream.calls == []


@pytest.mark.parametrize("param", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", ["5", 2.0, True])
def test_logprob_counts_must_be_integers(param: str, value: Any) -> None:
    guard, _ = make_guard()
    refused(call(guard, COMPLETIONS_PATH, body={**COMPLETION, param: value}), param, "invalid_type")


def test_max_logprobs_is_the_engines_value_too() -> None:
    catalog = Catalog.model_validate(
        {"models": [{"model_id": "m", "source": "/models/m", "max_model_len": 4096}], "limits": {"max_logprobs": 2}}
    )
    assert engine_kwargs(catalog.models[0], catalog)["max_logprobs"] == 2
    guard, _ = make_guard(max_logprobs=2)
    refused(call(guard, COMPLETIONS_PATH, body={**COMPLETION, "logprobs": 3}), "logprobs", "logprobs_exceeded")
    assert call(guard, COMPLETIONS_PATH, body={**COMPLETION, "logprobs": 2}).status == 200
    with pytest.raises(ValidationError, match="max_logprobs"):
        ModelEntry.model_validate(
            {"model_id": "m", "source": "/models/m", "max_model_len": 64, "engine_overrides": {"max_logprobs": 20}}
        )


def test_which_fields_ask_for_prompt_logprobs() -> None:
    # As vLLM's to_sampling_params decides; chat echo alone asks (top_logprobs defaults to 0).
    assert wants_prompt_logprobs(COMPLETIONS_PATH, {"echo": True}) is None
    assert wants_prompt_logprobs(COMPLETIONS_PATH, {"echo": True, "logprobs": 0}) == "echo"
    assert wants_prompt_logprobs(COMPLETIONS_PATH, {"logprobs": 5}) is None
    assert wants_prompt_logprobs(COMPLETIONS_PATH, {"prompt_logprobs": 0}) == "prompt_logprobs"
    assert wants_prompt_logprobs(CHAT_PATH, {"echo": True}) == "echo"
    assert wants_prompt_logprobs(CHAT_PATH, {"echo": True, "top_logprobs": None}) is None
    assert wants_prompt_logprobs(CHAT_PATH, {"logprobs": True}) is None


def test_prompt_logprobs_are_bounded_in_prompt_tokens() -> None:
    guard, downstream = make_guard(max_prompt_tokens=100, max_prompt_logprob_tokens=50)
    ids = list(range(60))
    refused(
        call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ids, "echo": True, "logprobs": 1}),
        "echo",
        "prompt_logprobs_exceeded",
    )
    refused(
        call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ids, "prompt_logprobs": 0}),
        "prompt_logprobs",
        "prompt_logprobs_exceeded",
    )
    # Without logprobs the same prompt is fine, and so is echo of a short one.
    assert call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ids, "echo": True}).status == 200
    assert (
        call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ids[:50], "echo": True, "logprobs": 5}).status
        == 200
    )
    assert len(downstream.calls) == 2


def test_chat_echo_is_bounded_by_the_exact_count() -> None:
    async def counter(path: str, body: dict[str, Any]) -> list[int]:
        return [60]

    guard, downstream = make_guard(counter, max_prompt_tokens=100, max_prompt_logprob_tokens=50)
    refused(call(guard, CHAT_PATH, body={**CHAT, "echo": True}), "echo", "prompt_logprobs_exceeded")
    assert call(guard, CHAT_PATH, body=CHAT).status == 200
    assert len(downstream.calls) == 1


# ---------------------------------------------------------------- prompts per request and their tokens


def test_the_attack_shape_is_refused_before_the_engine() -> None:
    # 1,024 prompts, echo, logprobs 20, max_tokens 0: vLLM's own cap is 1,024.
    guard, downstream = make_guard()
    attack = {"model": "m", "prompt": ["w " * 200] * 1024, "echo": True, "logprobs": 20, "max_tokens": 0}
    refused(call(guard, COMPLETIONS_PATH, body=attack), "logprobs", "logprobs_exceeded")
    error = refused(call(guard, COMPLETIONS_PATH, body={**attack, "logprobs": 5}), "prompt", "too_many_prompts")
    assert "1024 prompts" in error["message"] and "16" in error["message"]
    refused(
        call(guard, COMPLETIONS_PATH, body={**attack, "logprobs": 5, "prompt": [[7] * 10] * 17}),
        "prompt",
        "too_many_prompts",
    )
    assert downstream.calls == []


def test_prompts_per_request_are_capped() -> None:
    guard, downstream = make_guard(max_prompts=4, max_tokens=4)
    refused(call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ["a"] * 5}), "prompt", "too_many_prompts")
    assert call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ["a"] * 4}).status == 200
    assert len(downstream.calls) == 1


def test_max_tokens_zero_with_echo_does_not_escape_the_prompt_budget() -> None:
    # Each prompt at the limit, none generating: the total still counts.
    guard, downstream = make_guard(max_prompt_tokens=100)
    body = {"model": "m", "prompt": [[7] * 100] * 8, "echo": True, "max_tokens": 0}
    assert downstream.calls == []
    error = refused(call(guard, COMPLETIONS_PATH, body=body), "prompt", "context_length_exceeded")
    assert "800 tokens together" in error["message"] and "at most 100 per request" in error["message"]
    guard, _ = make_guard(max_prompt_tokens=100, max_request_prompt_tokens=800)
    assert call(guard, COMPLETIONS_PATH, body=body).status == 200
    refused(
        call(guard, COMPLETIONS_PATH, body={**body, "prompt": [[7] * 100] * 9}), "prompt", "context_length_exceeded"
    )


def test_text_prompts_of_a_batch_are_counted_together() -> None:
    counted: list[dict[str, Any]] = []

    async def counter(path: str, body: dict[str, Any]) -> list[int]:
        counted.append(body)
        return [len(p.split()) for p in body["prompt"]]

    guard, downstream = make_guard(counter, max_prompt_tokens=100, prompt_bytes_per_token=8)
    # Each prompt's byte bound is over 100 tokens: counted, 80 + 80 words > 100 together.
    body = {**COMPLETION, "prompt": ["w " * 80, "w " * 80]}
    error = refused(call(guard, COMPLETIONS_PATH, body=body), "prompt", "context_length_exceeded")
    assert "160 tokens together" in error["message"]
    # Small enough for the byte bound: no count needed.
    assert call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ["a b", "c d"]}).status == 200
    assert len(counted) == 1
    # More text over all prompts than the request's tokens can hold: refused unread.
    error = refused(
        call(guard, COMPLETIONS_PATH, body={**COMPLETION, "prompt": ["w" * 700] * 3}),
        "prompt",
        "context_length_exceeded",
    )
    assert "bytes of text together" in error["message"]
    assert len(counted) == 1 and downstream.calls[0][0] == COMPLETIONS_PATH and len(downstream.calls) == 1


def test_a_chat_prompt_is_always_counted_after_the_template() -> None:
    # A short chat whose template (system prompt, tools) renders past the
    # limit: the old byte bound passed it uncounted.
    seen: list[str] = []

    async def counter(path: str, body: dict[str, Any]) -> list[int]:
        seen.append(path)
        return [250]

    guard, downstream = make_guard(counter, max_prompt_tokens=200)
    error = refused(call(guard, CHAT_PATH, body=CHAT), "messages", "context_length_exceeded")
    assert "250 tokens" in error["message"]
    assert seen == [CHAT_PATH] and downstream.calls == []


def test_request_limits_reject_inconsistent_prompt_bounds() -> None:
    with pytest.raises(ValidationError, match="max_request_prompt_tokens"):
        RequestLimits(max_prompt_tokens=1000, max_request_prompt_tokens=999)
    with pytest.raises(ValidationError, match="max_prompts"):
        RequestLimits(max_prompts=1025)
    with pytest.raises(ValidationError, match="max_logprobs"):
        RequestLimits(max_logprobs=21)
    limits = RequestLimits(max_prompt_tokens=1000)
    assert limits.request_prompt_token_budget == 1000
    assert RequestLimits(max_prompt_tokens=1000, max_request_prompt_tokens=4000).request_prompt_token_budget == 4000


# ---------------------------------------------------------------- the vllm-server layout's counter


def vllm_guard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **limits: Any) -> tuple[VllmServerGuard, Downstream]:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    settings = {"api_keys_file": str(keys), "api_keys_env": "UNUSED", "limits": limits, "model_ids": ["m"]}
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(settings))
    downstream = Downstream()
    return VllmServerGuard(downstream), downstream


def test_the_vllm_server_guard_counts_with_vllms_tokenizer_and_template(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    app, downstream = vllm_guard(monkeypatch, tmp_path, max_tokens=16, max_prompt_tokens=10)
    tokenization = FakeTokenization()
    # Seven words and the template's three: at the limit. Eight: over it.
    chat = {"model": "m", "messages": [{"role": "user", "content": "w " * 7}], "max_tokens": 4}
    assert send_to(app, CHAT_PATH, body=chat, tokenization=tokenization)[0] == 200
    chat["messages"] = [{"role": "user", "content": "w " * 8}]
    status, doc = send_to(app, CHAT_PATH, body=chat, tokenization=tokenization)
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded"
    assert [type(r).__name__ for r in tokenization.requests] == ["TokenizeChatRequest"] * 2
    # Every prompt of a batch, one tokenize request each.
    body = {"model": "m", "prompt": ["w " * 6, "w " * 6], "max_tokens": 1}
    status, doc = send_to(app, COMPLETIONS_PATH, body=body, tokenization=tokenization)
    assert status == 400 and "12 tokens together" in doc["error"]["message"]
    assert [type(r).__name__ for r in tokenization.requests[2:]] == ["TokenizeCompletionRequest"] * 2
    assert downstream.paths == [CHAT_PATH]
    # Before vLLM's handlers exist nothing is served uncounted.
    app, downstream = vllm_guard(monkeypatch, tmp_path, max_tokens=16, max_prompt_tokens=10)
    status, doc = send_to(app, CHAT_PATH, body=chat, tokenization=None)
    assert status == 503 and doc["error"]["code"] == "prompt_not_measured"


def test_version_needs_a_key_and_is_not_served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # vllm-server answers it like every route it does not offer; behind
    # serve-ingress it needs a key like every route but the health probes.
    app, downstream = vllm_guard(monkeypatch, tmp_path)
    assert send_to(app, "/version", method="GET", key=None)[0] == 404
    assert send_to(app, "/version", method="GET")[0] == 404
    assert downstream.paths == []
    guard, recorder = make_guard()
    assert call(guard, "/version", key=None, method="GET", content_type=None).status == 401
    assert recorder.calls == []


# ---------------------------------------------------------------- /v1/models


VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "m",
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "s3://acme-llm-weights-prod/meta-llama/Llama-3.1-8B-Instruct",
            "parent": None,
            "max_model_len": 4096,
            "permission": [],
        }
    ],
}


@pytest.mark.parametrize("chunks", [1, 3])
def test_model_cards_do_not_name_the_weights(chunks: int) -> None:
    guard, _ = make_guard(downstream=Recorder(body=json.dumps(VLLM_MODELS).encode(), chunks=chunks))
    answer = call(guard, "/v1/models", method="GET", content_type=None)
    assert answer.status == 200 and b"s3://" not in answer.raw
    doc = json.loads(answer.raw)
    assert doc["data"][0]["root"] == "m" and doc["data"][0]["max_model_len"] == 4096
    assert int(answer.headers[b"content-length"]) == len(answer.raw)
    card = json.dumps(VLLM_MODELS["data"][0]).encode()
    guard, _ = make_guard(downstream=Recorder(body=card, chunks=chunks))
    answer = call(guard, "/v1/models/m", method="GET", content_type=None)
    assert answer.status == 200 and json.loads(answer.raw)["root"] == "m"


def test_model_cards_without_a_root_pass_unchanged() -> None:
    ray_cards = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "o", "metadata": {}}]}
    assert redact_model_cards(json.dumps(ray_cards).encode()) is None
    assert redact_model_cards(b"not json") is None
    raw = json.dumps(ray_cards).encode()
    guard, _ = make_guard(downstream=Recorder(body=raw))
    assert call(guard, "/v1/models", method="GET", content_type=None).raw == raw
