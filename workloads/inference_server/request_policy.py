"""The request model the guard accepts on the generation routes, and the bounds on what the engine sees.

vLLM's request models take any field (``extra="allow"``) and hand several of
them straight to the engine or the chat template: a prompt the guard never
counted (``kv_transfer_params.prompt_token_ids``, ``refusal``/``thinking``/
``tool_reference`` content parts, ``documents``, message ``reasoning``,
``chat_template_kwargs``), or work the API server does on its one event loop
(prompt logprobs for every token of up to 1,024 prompts). So the guard works
from an allow-list instead: the fields below, and in chat messages only text
content parts. Everything else gets an OpenAI-style 400 naming the field.

The allow-list is vLLM 0.29's own request models
(``vllm/entrypoints/openai/{chat_completion,completion}/protocol.py``, which
Ray Serve LLM 2.60 subclasses unchanged) cut down to the OpenAI API's fields
plus the vLLM sampling switches whose cost the limits already bound. The
router in front of the vllm-server replicas (vllm-router) adds fields of its
own to every body it forwards; those are accepted at the router's values only
(:data:`ROUTER_VALUES`), and the ones vLLM does not define are removed before
vLLM parses the body (:func:`strip_router_fields`).

With the fields fixed, the prompt is what the engine will see: the guard
counts it with the engine's own tokenizer and chat template (every prompt of
a batch), and bounds the prompts per request, their tokens together, and the
prompt tokens a request may ask logprobs for (:class:`~.catalog.RequestLimits`).

Pure functions over the parsed body; the guard turns a :class:`PolicyError`
into its answer. Needs only the standard library and the catalogue.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .catalog import RequestLimits

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# ---------------------------------------------------------------- the allow-list
#
# Why each family is accepted:
#
# * OpenAI's own parameters of the route, as vLLM implements them. Their cost
#   is bounded by the other limits (max_tokens, n, the output budget) or is a
#   per-step constant on the engine (penalties, logit_bias, stop strings).
OPENAI_SHARED = frozenset(
    {
        "model",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "user",
    }
)
OPENAI_CHAT = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
# `echo` and `logprobs` here are the legacy completions API's; both are
# bounded below (max_logprobs, max_prompt_logprob_tokens).
OPENAI_COMPLETIONS = frozenset({"prompt", "echo", "logprobs"})
# * vLLM's sampling switches: they change which token the engine picks, at a
#   per-step cost that does not grow with the request (ignore_eos and
#   min_tokens only fill up to max_tokens, which the output budget counts).
#   Clients of vLLM-compatible servers send them (the benchmarks do).
VLLM_SAMPLING = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
    }
)
# * vLLM's output extras whose size the prompt limits bound: prompt logprobs
#   (bounded by max_logprobs and max_prompt_logprob_tokens) and the token ids
#   of prompt and answer.
VLLM_OUTPUT = frozenset({"prompt_logprobs", "return_token_ids"})
# * vLLM's chat switches that only choose how the messages are rendered; the
#   guard's exact count renders them the same way. Chat `echo` repeats the
#   last message and asks prompt logprobs (bounded like the above).
VLLM_CHAT = frozenset({"add_generation_prompt", "continue_final_message", "echo"})

# The fields vllm-router 0.1.17 (the router in front of the vllm-server
# replicas) writes into every body it forwards when the client left them out:
# it parses each request into its own request type and serializes that type
# back, defaults included. A value the client sent passes it unchanged, so each
# field is accepted at the router's value alone (that JSON boolean, never
# "false" or 0) and any other value is refused as a client's. The router also
# writes `stream`, `echo` (completions), `logprobs`, `continue_final_message`
# (chat), `ignore_eos` and `skip_special_tokens` at vLLM's own defaults; those
# are in the allow-list above at either value, as before.
# tests/test_router_bodies.py runs the router requirements-dev.txt pins and holds this list.
ROUTER_VALUES: dict[str, dict[str, bool]] = {
    CHAT_PATH: {
        "include_reasoning": True,
        "no_stop_trim": False,
        "return_hidden_states": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
    },
    COMPLETIONS_PATH: {"no_stop_trim": False, "return_hidden_states": False},
}
# Of those, the ones vLLM 0.29's request models do not define (SGLang's
# names): vLLM would keep them as extras it never reads. They are removed
# before vLLM parses the body, so every field vLLM sees is one of the
# allow-list's, and a later vLLM that gives one of these names a meaning can
# not act on a value nobody reviewed. `include_reasoning` is vLLM's own (chat,
# default true) and passes at that value.
ROUTER_ONLY_FIELDS = frozenset({"no_stop_trim", "return_hidden_states", "separate_reasoning", "stream_reasoning"})
# Why a client's own value is refused; shown after the value accepted.
_NOT_IMPLEMENTED = "the engine does not implement it"
ROUTER_VALUE_REASONS = {
    "include_reasoning": "answers carry the reasoning as the model's reasoning parser splits it",
    "no_stop_trim": f"{_NOT_IMPLEMENTED}; use include_stop_str_in_output",
    "return_hidden_states": _NOT_IMPLEMENTED,
    "separate_reasoning": _NOT_IMPLEMENTED,
    "stream_reasoning": _NOT_IMPLEMENTED,
}

ALLOWED_FIELDS = {
    CHAT_PATH: OPENAI_SHARED | OPENAI_CHAT | VLLM_SAMPLING | VLLM_OUTPUT | VLLM_CHAT,
    COMPLETIONS_PATH: OPENAI_SHARED | OPENAI_COMPLETIONS | VLLM_SAMPLING | VLLM_OUTPUT,
}

# Why the fields clients are most likely to try are refused; any other field
# gets the generic message. Each reason is shown to the client.
_TEMPLATE_INPUT = "it reaches the chat template outside the messages the request limits count"
REFUSED_FIELDS = {
    "kv_transfer_params": "it hands the engine a prompt the request limits never see",
    "ec_transfer_params": "it hands the engine inputs the request limits never see",
    "prompt_embeds": "its tokens bypass the tokenizer the request limits count with",
    "documents": _TEMPLATE_INPUT,
    "chat_template": "the server renders every chat with the model's own template",
    "chat_template_kwargs": _TEMPLATE_INPUT,
    "reasoning_effort": _TEMPLATE_INPUT,
    "mm_processor_kwargs": "the served models take text only",
    "media_io_kwargs": "the served models take text only",
    "priority": "scheduling priority is set by the server, not per request",
    "vllm_xargs": "it passes arguments to engine plugins",
    "structured_outputs": "use response_format",
    "use_beam_search": "beam search is not offered",
    "length_penalty": "beam search is not offered",
    "best_of": "the engine does not implement it; use n",
    "suffix": "the engine does not implement it",
    "truncate_prompt_tokens": "send the prompt you want served",
    "request_id": "the server assigns request ids",
}

# Chat messages: the roles of the OpenAI API and the fields each may carry.
# Everything here is rendered by the chat template and so counted exactly.
MESSAGE_FIELDS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
REFUSED_MESSAGE_FIELDS = {
    "reasoning": _TEMPLATE_INPUT,
    "reasoning_content": _TEMPLATE_INPUT,
    "refusal": "send it as text content",
    "function_call": "use tool_calls",
    "audio": "the served models take text only",
}
# Content parts: text only. vLLM also joins refusal, thinking and
# tool_reference parts into the prompt and fetches media parts by URL; the
# served models are text models.
CONTENT_PART_TYPES = frozenset({"text"})
TEXT_PART_FIELDS = frozenset({"type", "text"})
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
TOOL_CALL_FIELDS = frozenset({"id", "type", "function"})
TOOL_CALL_FUNCTION_FIELDS = frozenset({"name", "arguments"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
# response_format as the OpenAI API defines it (vLLM's own "structural_tag" is left out).
RESPONSE_FORMAT_TYPES = frozenset({"text", "json_object", "json_schema"})
RESPONSE_FORMAT_FIELDS = frozenset({"type", "json_schema"})
JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})
STREAM_OPTION_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})
# Switches the request models would coerce from "true" or 1: JSON booleans only.
BOOLEAN_FIELDS = (
    "stream",
    "echo",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "return_token_ids",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
)


@dataclass(frozen=True)
class PolicyError:
    """A request the policy refuses: the guard answers it with ``status`` and an OpenAI error body."""

    message: str
    param: str | None
    code: str
    status: int = 400


class PromptBound(Protocol):
    """What the guard knows of one prompt before tokenizing (its ``PromptSize``)."""

    @property
    def text_bytes(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def exact(self) -> bool: ...


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"


def _unsupported(field: str, param: str, reasons: dict[str, str]) -> PolicyError:
    reason = reasons.get(field)
    shown = field if len(field) <= 64 else field[:64] + "..."
    if reason is None:
        return PolicyError(
            f"Unrecognized request argument supplied: {shown}", param=param, code="unsupported_parameter"
        )
    return PolicyError(f"{shown} is not accepted by this server: {reason}.", param=param, code="unsupported_parameter")


def _invalid(message: str, param: str) -> PolicyError:
    return PolicyError(message, param=param, code="invalid_value")


def _unknown_key(value: dict[str, Any], allowed: frozenset[str], param: str) -> PolicyError | None:
    for key in value:
        if key not in allowed:
            return _unsupported(str(key), f"{param}.{key}", {})
    return None


# ---------------------------------------------------------------- fields and shapes


def check_fields(path: str, body: dict[str, Any]) -> PolicyError | None:
    """400 for a field, message field or content part outside the allow-list, or a shape it does not define."""
    allowed = ALLOWED_FIELDS.get(path)
    if allowed is None:
        return None
    router_values = ROUTER_VALUES[path]
    for field in body:
        if field in router_values:
            refusal = _check_router_value(field, body[field], router_values[field])
            if refusal is not None:
                return refusal
        elif field not in allowed:
            return _unsupported(str(field), str(field), REFUSED_FIELDS)
    for field in BOOLEAN_FIELDS:
        value = body.get(field)
        if value is not None and not isinstance(value, bool):
            return PolicyError(f"{field} must be a boolean, not {_kind(value)}.", param=field, code="invalid_type")
    if path == COMPLETIONS_PATH:
        if "prompt" not in body:
            return PolicyError("prompt is required.", param="prompt", code="invalid_prompt")
    else:
        refusal = check_messages(body.get("messages"))
        if refusal is None:
            refusal = _check_tools(body)
        if refusal is None and body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            refusal = PolicyError(
                f"logprobs must be a boolean, not {_kind(body['logprobs'])}.", param="logprobs", code="invalid_type"
            )
        if refusal is not None:
            return refusal
    return _check_response_format(body.get("response_format")) or _check_stream_options(body.get("stream_options"))


def _check_router_value(field: str, value: Any, accepted: bool) -> PolicyError | None:
    # `is`: True and False are singletons, and neither 1, 1.0 nor "true" is one of them.
    if value is accepted:
        return None
    if isinstance(value, str):
        shown = json.dumps(value[:40])
    elif isinstance(value, (bool, int, float)) or value is None:
        shown = json.dumps(value)
    else:
        shown = _kind(value)
    return PolicyError(
        f"{field} is accepted only as {json.dumps(accepted)} by this server, not {shown}: "
        f"{ROUTER_VALUE_REASONS[field]}.",
        param=field,
        code="unsupported_value",
    )


def strip_router_fields(path: str, body: dict[str, Any]) -> bool:
    """Remove the router's fields vLLM does not define (:data:`ROUTER_ONLY_FIELDS`); True when any was there.

    Only for a body :func:`check_fields` accepted, whose router fields hold the router's values.
    """
    if path not in ROUTER_VALUES:
        return False
    present = [field for field in ROUTER_ONLY_FIELDS if field in body]
    for field in present:
        del body[field]
    return bool(present)


def encode_body(body: dict[str, Any]) -> bytes:
    """The body as JSON in UTF-8, for the server behind the guard to parse into the same values.

    Every string has a UTF-8 form: the guard refuses a body with an unpaired
    surrogate escape before it gets here (guard.parse_json_object).
    """
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def check_messages(messages: Any) -> PolicyError | None:
    """Chat messages as the OpenAI API defines them, with text content only."""
    if not isinstance(messages, list) or not messages:
        return _invalid("messages must be a non-empty array of message objects.", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            return _invalid(f"{where} must be an object, not {_kind(message)}.", where)
        role = message.get("role")
        fields = MESSAGE_FIELDS.get(role) if isinstance(role, str) else None
        if fields is None:
            shown = json.dumps(role)[:40]
            return _invalid(
                f"{where}.role is {shown}; supported roles are {', '.join(sorted(MESSAGE_FIELDS))}.", f"{where}.role"
            )
        for key in message:
            if key not in fields:
                return _unsupported(str(key), f"{where}.{key}", REFUSED_MESSAGE_FIELDS)
        for key in ("name", "tool_call_id"):
            if key in message and not isinstance(message[key], str):
                return _invalid(f"{where}.{key} must be a string.", f"{where}.{key}")
        refusal = _check_content(message.get("content"), where, nullable=role == "assistant")
        if refusal is None and "tool_calls" in message:
            refusal = _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if refusal is not None:
            return refusal
    return None


def _check_content(content: Any, where: str, *, nullable: bool) -> PolicyError | None:
    if isinstance(content, str) or (content is None and nullable):
        return None
    if not isinstance(content, list):
        return _invalid(f"{where}.content must be a string or an array of text parts.", f"{where}.content")
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            return _invalid(f"{at} must be an object like {{'type': 'text', 'text': ...}}.", at)
        kind = part.get("type")
        if kind not in CONTENT_PART_TYPES:
            shown = json.dumps(kind)[:40] if kind is not None else "missing"
            return _invalid(
                f"{at}.type is {shown}: this server accepts only text content parts ({{'type': 'text', 'text': ...}}).",
                f"{at}.type",
            )
        refusal = _unknown_key(part, TEXT_PART_FIELDS, at)
        if refusal is not None:
            return refusal
        if not isinstance(part.get("text"), str):
            return _invalid(f"{at}.text must be a string.", f"{at}.text")
    return None


def _check_tool_calls(calls: Any, where: str) -> PolicyError | None:
    if not isinstance(calls, list):
        return _invalid(f"{where} must be an array.", where)
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            return _invalid(f"{at} must be an object of type 'function'.", at)
        refusal = _unknown_key(call, TOOL_CALL_FIELDS, at)
        if refusal is not None:
            return refusal
        function = call.get("function")
        if not isinstance(function, dict):
            return _invalid(f"{at}.function must be an object.", f"{at}.function")
        refusal = _unknown_key(function, TOOL_CALL_FUNCTION_FIELDS, f"{at}.function")
        if refusal is not None:
            return refusal
    return None


def _check_tools(body: dict[str, Any]) -> PolicyError | None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return _invalid("tools must be an array.", "tools")
        for k, tool in enumerate(tools):
            at = f"tools[{k}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                return _invalid(f"{at} must be an object of type 'function'.", at)
            refusal = _unknown_key(tool, TOOL_FIELDS, at)
            if refusal is not None:
                return refusal
            function = tool.get("function")
            if not isinstance(function, dict):
                return _invalid(f"{at}.function must be an object.", f"{at}.function")
            refusal = _unknown_key(function, FUNCTION_FIELDS, f"{at}.function")
            if refusal is not None:
                return refusal
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        return None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return _unknown_key(choice, TOOL_FIELDS, "tool_choice") or _unknown_key(
            choice["function"], frozenset({"name"}), "tool_choice.function"
        )
    return _invalid(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
        "tool_choice",
    )


def _check_response_format(value: Any) -> PolicyError | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        return _invalid(
            f"response_format.type must be one of {', '.join(sorted(RESPONSE_FORMAT_TYPES))}.", "response_format.type"
        )
    refusal = _unknown_key(value, RESPONSE_FORMAT_FIELDS, "response_format")
    schema = value.get("json_schema")
    if refusal is None and isinstance(schema, dict):
        refusal = _unknown_key(schema, JSON_SCHEMA_FIELDS, "response_format.json_schema")
    return refusal


def _check_stream_options(value: Any) -> PolicyError | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return _invalid("stream_options must be an object.", "stream_options")
    return _unknown_key(value, STREAM_OPTION_FIELDS, "stream_options")


# ---------------------------------------------------------------- logprobs


def check_logprobs(path: str, body: dict[str, Any], limits: RequestLimits) -> PolicyError | None:
    """400 unless every logprob count is a JSON integer from 0 to ``limits.max_logprobs``.

    The engine refuses more than its ``max_logprobs`` too (the same catalogue
    value), but only after the API server parsed the request; -1, which the
    engine reads as "the whole vocabulary", never reaches it.
    """
    params = ["top_logprobs", "prompt_logprobs"] if path == CHAT_PATH else ["logprobs", "prompt_logprobs"]
    for param in params:
        value = body.get(param)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            return PolicyError(f"{param} must be an integer, not {_kind(value)}.", param=param, code="invalid_type")
        if not 0 <= value <= limits.max_logprobs:
            return PolicyError(
                f"{param} is {value}, but this server accepts 0 to {limits.max_logprobs}. Lower {param}.",
                param=param,
                code="logprobs_exceeded",
            )
    return None


def wants_prompt_logprobs(path: str, body: dict[str, Any]) -> str | None:
    """The field that makes the engine return logprobs for every prompt token, or None.

    As vLLM 0.29's ``to_sampling_params`` decides: ``prompt_logprobs``, or
    ``echo`` with ``logprobs`` (completions) or with ``top_logprobs``, which
    defaults to 0 and so asks for them whenever chat ``echo`` is on.
    """
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("echo"):
        if path == COMPLETIONS_PATH and body.get("logprobs") is not None:
            return "echo"
        if path == CHAT_PATH and body.get("top_logprobs", 0) is not None:
            return "echo"
    return None


# ---------------------------------------------------------------- prompts


def check_prompt_count(prompts: int, limits: RequestLimits) -> PolicyError | None:
    """400 for more prompts in one /v1/completions request than ``limits.max_prompts``."""
    if prompts > limits.max_prompts:
        return PolicyError(
            f"The request has {prompts} prompts, but this server accepts at most {limits.max_prompts} per request. "
            "Send fewer prompts per request.",
            param="prompt",
            code="too_many_prompts",
        )
    return None


def _prompt_param(path: str) -> str:
    return "prompt" if path == COMPLETIONS_PATH else "messages"


def _prompt_too_long(tokens: int, limits: RequestLimits, param: str, index: int | None) -> PolicyError:
    which = "The prompt" if index is None else f"Prompt {index}"
    return PolicyError(
        f"{which} has {tokens} tokens, but this server accepts at most {limits.max_prompt_tokens}. Shorten the prompt.",
        param=param,
        code="context_length_exceeded",
    )


def _total_too_long(tokens: int, limits: RequestLimits, param: str) -> PolicyError:
    return PolicyError(
        f"The request's prompts have {tokens} tokens together, but this server accepts at most "
        f"{limits.request_prompt_token_budget} per request. Send fewer or shorter prompts.",
        param=param,
        code="context_length_exceeded",
    )


def _logprobs_too_long(tokens: int, limits: RequestLimits, param: str) -> PolicyError:
    return PolicyError(
        f"{param} asks logprobs for {tokens} prompt tokens, but this server returns them for at most "
        f"{limits.max_prompt_logprob_tokens} per request. Shorten the prompt or leave {param} out.",
        param=param,
        code="prompt_logprobs_exceeded",
    )


def plan_prompt_check(
    path: str, body: dict[str, Any], sizes: Sequence[PromptBound], limits: RequestLimits
) -> PolicyError | bool:
    """Decide on the prompts without a tokenizer where that is sound; True when an exact count is needed.

    Token ids are counted here, exactly. Text is refused unread when it holds
    more bytes than its token limit at ``prompt_bytes_per_token`` (per prompt,
    and over all prompts of the request). A completion prompt's text whose
    bytes (plus the special tokens) fit every limit needs no count: a token of
    a byte-level BPE or SentencePiece vocabulary covers at least one byte. A
    chat prompt always needs one: the model's template adds text the guard
    can not bound without rendering it.
    """
    param = _prompt_param(path)
    logprob_param = wants_prompt_logprobs(path, body)
    total_limit = limits.request_prompt_token_budget
    if logprob_param is not None:
        total_limit = min(total_limit, limits.max_prompt_logprob_tokens)
    byte_cap = limits.max_prompt_tokens * limits.prompt_bytes_per_token
    needs_count = path == CHAT_PATH
    exact_total = bound_total = text_total = 0
    for index, size in enumerate(sizes):
        shown = index if len(sizes) > 1 else None
        if size.exact:
            if size.tokens > limits.max_prompt_tokens:
                return _prompt_too_long(size.tokens, limits, param, shown)
            exact_total += size.tokens
        elif size.text_bytes > byte_cap:
            return PolicyError(
                f"The prompt{'' if shown is None else f' {shown}'} has {size.text_bytes} bytes of text, more than "
                f"the {limits.max_prompt_tokens} tokens this server accepts can hold (at most {byte_cap} bytes). "
                "Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        elif size.tokens > limits.max_prompt_tokens:
            needs_count = True
        bound_total += size.tokens
        text_total += size.text_bytes
    if exact_total > limits.request_prompt_token_budget:
        return _total_too_long(exact_total, limits, param)
    if logprob_param is not None and exact_total > limits.max_prompt_logprob_tokens:
        return _logprobs_too_long(exact_total, limits, logprob_param)
    total_bytes_cap = total_limit * limits.prompt_bytes_per_token
    if text_total > total_bytes_cap:
        return PolicyError(
            f"The request's prompts have {text_total} bytes of text together, more than the {total_limit} tokens "
            f"this server accepts per request can hold (at most {total_bytes_cap} bytes). "
            "Send fewer or shorter prompts.",
            param=param,
            code="context_length_exceeded",
        )
    return needs_count or bound_total > total_limit


def check_counted(
    path: str, body: dict[str, Any], counts: Sequence[int] | None, limits: RequestLimits
) -> PolicyError | None:
    """The limits against the exact token counts, one per prompt (a chat request has one)."""
    param = _prompt_param(path)
    if not counts:
        return PolicyError(
            f"The {param} could not be tokenized with the model's tokenizer and chat template.",
            param=param,
            code="invalid_prompt",
        )
    for index, tokens in enumerate(counts):
        if tokens > limits.max_prompt_tokens:
            return _prompt_too_long(tokens, limits, param, index if len(counts) > 1 else None)
    total = sum(counts)
    if total > limits.request_prompt_token_budget:
        return _total_too_long(total, limits, param)
    logprob_param = wants_prompt_logprobs(path, body)
    if logprob_param is not None and total > limits.max_prompt_logprob_tokens:
        return _logprobs_too_long(total, limits, logprob_param)
    return None


# ---------------------------------------------------------------- /v1/models

MODELS_PATH = "/v1/models"
# Model lists are small; a larger answer is passed on unchanged.
MAX_MODELS_BODY_BYTES = 1024 * 1024


def is_models_path(path: str) -> bool:
    """Whether ``path`` answers with model cards (the list or one model)."""
    return path == MODELS_PATH or path.startswith(MODELS_PATH + "/")


def redact_model_cards(raw: bytes) -> bytes | None:
    """The model cards with ``root`` replaced by the model's id, or None when nothing needed changing.

    vLLM's card sets ``root`` to the path it loaded the weights from (an S3
    URI in production), which no key holder needs to know. The field stays,
    holding the served name, so clients that parse vLLM's card keep working.
    """
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    cards: list[Any] = doc["data"] if isinstance(doc, dict) and isinstance(doc.get("data"), list) else [doc]
    changed = False
    for card in cards:
        if isinstance(card, dict) and "root" in card and card["root"] != card.get("id"):
            card["root"] = card.get("id")
            changed = True
    return json.dumps(doc).encode() if changed else None


def without_weights_location(send: Send) -> Send:
    """A ``send`` that passes a successful model-card answer through :func:`redact_model_cards`."""
    held: Message | None = None
    chunks: list[bytes] = []
    size = 0

    async def redacting(message: Message) -> None:
        nonlocal held, size
        kind = message["type"]
        if kind == "http.response.start" and int(message.get("status", 200)) == 200:
            held = message
            return
        if held is None or kind != "http.response.body":
            if held is not None:
                start, held = held, None
                await send(start)
                if chunks:
                    await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
            await send(message)
            return
        body = bytes(message.get("body", b""))
        chunks.append(body)
        size += len(body)
        more = bool(message.get("more_body", False))
        if size > MAX_MODELS_BODY_BYTES or more:
            if size > MAX_MODELS_BODY_BYTES:
                start, held = held, None
                await send(start)
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": more})
            return
        start, held = held, None
        raw = b"".join(chunks)
        new_body = redact_model_cards(raw)
        if new_body is None:
            await send(start)
            await send({"type": "http.response.body", "body": raw, "more_body": False})
            return
        headers = [(bytes(k), bytes(v)) for k, v in start.get("headers") or () if bytes(k).lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": new_body, "more_body": False})

    return redacting
