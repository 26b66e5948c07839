"""The rules the capacity plan enforces: one config error line each, naming the model and the numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from infra.capacity.geometry import PINNED
from infra.config import parse
from tests.harness import config_problems as problems
from tests.harness import stack_sections

LLAMA_70B = PINNED[1].geometry.model_dump()
MYSTERY = {"source": "s3://acme-llm-weights-dev/acme/mystery-7b", "model_id": "mystery-7b"}


def test_the_example_stacks_pass_and_state_the_pinned_parameter_counts() -> None:
    for stack in ("dev", "prod"):
        cfg = parse(stack_sections(stack))
        for model in cfg.models:
            pinned = next(p for p in PINNED if p.hub_id in model.source)
            assert model.parameters_billion == pytest.approx(pinned.parameters / 1e9, abs=0.05)


def test_an_unknown_model_without_geometry_is_refused_in_one_line() -> None:
    assert problems("dev", lambda raw: raw["models"][0].update(MYSTERY)) == [
        "config error: models[0].geometry: 'llama-31-8b' (s3://acme-llm-weights-dev/acme/mystery-7b, model_id "
        "'mystery-7b') is not a model of the pinned table (meta-llama/Llama-3.1-8B-Instruct, "
        "meta-llama/Llama-3.3-70B-Instruct): add a geometry block from its config.json (num_hidden_layers, "
        "num_attention_heads, num_key_value_heads, head_dim, hidden_size, intermediate_size, vocab_size, "
        "max_position_embeddings, tie_word_embeddings) so its KV cache can be planned"
    ]


def test_a_geometry_block_makes_an_unknown_model_plannable() -> None:
    geometry = {**PINNED[0].geometry.model_dump(), "num_hidden_layers": 30}
    assert problems("dev", lambda raw: raw["models"][0].update(MYSTERY, geometry=geometry)) == []


def test_a_geometry_block_is_checked_like_any_section() -> None:
    bad = {**LLAMA_70B, "num_key_value_heads": 5, "attention_heads": 64}
    assert problems("prod", lambda raw: raw["models"][1].update(geometry=bad)) == [
        "config error: models[1].geometry.attention_heads: unknown key",
    ]
    assert problems("prod", lambda raw: raw["models"][1].update(geometry={**LLAMA_70B, "num_key_value_heads": 5})) == [
        "config error: models[1].geometry: num_key_value_heads (5) must divide num_attention_heads (64): each KV "
        "head serves a whole group of attention heads"
    ]


def test_max_model_len_may_not_exceed_the_context_limit() -> None:
    assert problems("dev", lambda raw: raw["models"][0].update(max_model_len=200_000)) == [
        "config error: models[0].max_model_len: 'llama-31-8b': 200,000 exceeds the model's context limit of "
        "131,072 tokens (max_position_embeddings)"
    ]
    short = {**PINNED[0].geometry.model_dump(), "max_position_embeddings": 4096}
    assert problems("dev", lambda raw: raw["models"][0].update(MYSTERY, geometry=short)) == [
        "config error: models[0].max_model_len: 'llama-31-8b': 8,192 exceeds the model's context limit of "
        "4,096 tokens (max_position_embeddings)"
    ]


def test_tensor_parallel_must_divide_the_attention_heads() -> None:
    geometry = {**LLAMA_70B, "num_attention_heads": 6, "num_key_value_heads": 2}
    assert problems("prod", lambda raw: raw["models"][1].update(geometry=geometry)) == [
        "config error: models[1].tensor_parallel_size: 'llama-33-70b': 4 does not divide the model's 6 attention "
        "heads (vLLM shards them over the TP ranks)"
    ]


def test_tensor_parallel_must_divide_the_kv_heads_or_replicate_them() -> None:
    geometry = {**LLAMA_70B, "num_attention_heads": 12, "num_key_value_heads": 6}
    assert problems("prod", lambda raw: raw["models"][1].update(geometry=geometry)) == [
        "config error: models[1].tensor_parallel_size: 'llama-33-70b': 4 neither divides the model's 6 KV heads "
        "nor is a multiple of them (vLLM shards the KV heads over the TP ranks, or replicates each over "
        "TP / KV heads ranks)"
    ]
    # Two KV heads on four ranks: vLLM keeps each on two of them.
    replicated = {**LLAMA_70B, "num_attention_heads": 8, "num_key_value_heads": 2}
    assert problems("prod", lambda raw: raw["models"][1].update(geometry=replicated)) == []


def test_the_kv_cache_must_hold_one_max_model_len_sequence() -> None:
    assert problems("dev", lambda raw: raw["models"][0].update(gpu_memory_utilization=0.8)) == [
        "config error: models[0].max_model_len: 'llama-31-8b': the KV cache holds 4,704 tokens (294 blocks of 16 "
        "besides vLLM's null block; L4 22.0 GiB (what CUDA reports) x gpu_memory_utilization 0.8, less 15.0 GiB of "
        "weights and 2.1 GiB of activations, CUDA graphs and buffers (estimated), leaves 0.6 GiB at 131,072 bytes a "
        "token per GPU), "
        "less than one max_model_len sequence of 8,192 tokens: vLLM would refuse to start; lower max_model_len, "
        "raise gpu_memory_utilization, add GPUs (tensor_parallel_size) or set kv_cache_dtype fp8"
    ]


# A replica whose KV cache holds one or two sequences is also let hold fewer
# requests at once (the in-flight rule, tests/test_fairness.py): these
# tests are about the KV cache alone.
SMALL_INFLIGHT = {"target_ongoing_requests": 8, "max_ongoing_requests": 16}


def test_each_remedy_the_kv_rule_names_works() -> None:
    def tight(**extra: Any) -> Callable[[dict[str, Any]], None]:
        def change(raw: dict[str, Any]) -> None:
            raw["models"][0].update(gpu_memory_utilization=0.8, **extra)
            raw["models"][0]["autoscaling"].update(SMALL_INFLIGHT)
            raw["serving"]["limits"].update(max_tokens=1024, max_prompt_tokens=2048)

        return change

    assert problems("dev", tight()) != []
    assert problems("dev", tight(max_model_len=4096)) == []
    assert problems("dev", tight(engine_overrides={"kv_cache_dtype": "fp8"})) == []
    assert problems("dev", tight(engine_overrides={"enforce_eager": True})) == []


def test_the_kv_rule_follows_kv_cache_memory_bytes() -> None:
    blocks = 8192 // 16 + 1  # one sequence and vLLM's null block
    exact = {"kv_cache_memory_bytes": blocks * 16 * 131072}

    def small(raw: dict[str, Any]) -> None:
        raw["models"][0].update(engine_overrides=exact)
        raw["models"][0]["autoscaling"].update(SMALL_INFLIGHT)

    assert problems("dev", small) == []
    short = {"kv_cache_memory_bytes": blocks * 16 * 131072 - 1}
    (line,) = problems("dev", lambda raw: raw["models"][0].update(engine_overrides=short))
    assert line.startswith(
        "config error: models[0].max_model_len: 'llama-31-8b': the KV cache holds 8,176 tokens (511 blocks of 16 "
        f"besides vLLM's null block; kv_cache_memory_bytes {short['kv_cache_memory_bytes']:,} at 131,072 bytes"
    )


def test_weights_beyond_the_gpu_are_reported_by_the_weights_rule_alone() -> None:
    (line,) = problems("dev", lambda raw: raw["models"][0].update(parameters_billion=13))
    assert line.startswith(
        "config error: models[0]: weights of 24.2 GiB do not fit 1 x L4 22.0 GiB (what CUDA reports of its 24 GB)"
    )


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    assert problems("prod", lambda raw: raw["models"][1]["engine_overrides"].update(kv_cache_dtype="int8")) == [
        "config error: models[1].engine_overrides.kv_cache_dtype: 'int8' is not a KV cache dtype the capacity plan "
        "sizes (auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"
    ]


def test_max_prompt_tokens_above_max_model_len_is_the_limits_rule() -> None:
    """The prompt-length rule already exists (serving.limits); the capacity rules do not repeat it."""
    (line,) = problems("dev", lambda raw: raw["serving"]["limits"].update(max_prompt_tokens=9000))
    assert line.startswith("config error: serving.limits.max_prompt_tokens: 9000 is not below the max_model_len")


@pytest.mark.parametrize("value", [0, -16, 12.5, "lots", True])
def test_the_engine_numbers_the_plan_reads_are_positive_integers(value: Any) -> None:
    assert problems("dev", lambda raw: raw["models"][0].update(engine_overrides={"block_size": value})) == [
        f"config error: models[0].engine_overrides.block_size: {value!r} is not a positive integer"
    ]
    # A number as a string, as YAML may give it: read as the number (2: what dev's cache holds at its profile).
    assert problems("dev", lambda raw: raw["models"][0].update(engine_overrides={"max_num_seqs": "2"})) == []
    (line,) = problems("dev", lambda raw: raw["models"][0].update(engine_overrides={"max_num_seqs": "32"}))
    assert line.startswith("config error: models[0].engine_overrides.max_num_seqs: 'llama-31-8b': 32 sequences")
