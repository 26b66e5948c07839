"""A model's workload profile: the sequences a replica runs at once without preemption, the recommended
max_num_seqs and the estimates at the profile, the `workload` block that gives it, and the rule it drives."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra.capacity.geometry import resolve_geometry
from infra.capacity.kv_band import replica_kv_band
from infra.capacity.plan import Device, plan_replica
from infra.capacity.report import plan_stack, preemption_warning, stack_output, text, workload_line
from infra.capacity.workload import (
    RECOMMENDED_SHARE,
    Tokens,
    Workload,
    concurrency,
    full_length,
    percentile,
    profile_of,
)
from infra.config import capacity_input, parse, preemption_free_sequences
from infra.instance_types import GPU_INSTANCE_TYPES
from tests.harness import config_problems as problems
from tests.harness import engine, stack_sections

LLAMA_8B = resolve_geometry(None, "s3://b/meta-llama/Llama-3.1-8B-Instruct", "x")
L4 = GPU_INSTANCE_TYPES["g6.2xlarge"]
BLOCK_BYTES = 16 * 131072  # a block of 16 tokens of the 8B at 128 KiB a token
# 4,096 + 1,024 tokens at p95: 320 blocks of 16; 1,500 + 300 at the mean: 113.
CHAT = Workload(Tokens(1500, 4096), Tokens(300, 1024), "test")


def _at(blocks: int, workload: Workload = CHAT, **changes: Any) -> Any:
    """The concurrency of an 8B replica whose KV cache is exactly `blocks` blocks (kv_cache_memory_bytes)."""
    assert LLAMA_8B is not None
    settings = engine(kv_cache_memory_bytes=blocks * BLOCK_BYTES, **changes)
    plan = plan_replica(LLAMA_8B, 8.03, settings, Device.of(L4))
    return concurrency(plan, replica_kv_band(LLAMA_8B, 8.03, settings, L4), workload)


# --- The arithmetic. ---


def test_the_preemption_free_load_is_the_usable_blocks_over_a_p95_sequences_blocks() -> None:
    at = _at(5000)
    # vLLM's null block aside; 4,096 + 1,024 tokens = 320 blocks.
    assert (at.usable_blocks, at.p95_blocks) == (4999, 320)
    assert at.preemption_free == 4999 // 320 == 15
    assert at.recommended == int(15 * RECOMMENDED_SHARE) == 13
    # A mean sequence ends at 1,800 tokens: 113 blocks.
    assert (at.mean_blocks, at.at_mean) == (113, 4999 // 113)
    assert not at.preempts(15) and at.preempts(16)


def test_a_sequence_takes_whole_blocks() -> None:
    # 4,097 + 1,024 tokens spill into a 321st block: one block short of 16 x 321, so 15 fit, not 16.
    longer = Workload(Tokens(1500, 4097), Tokens(300, 1024), "test")
    assert _at(16 * 321, longer).preemption_free == 15
    assert _at(16 * 321 + 1, longer).preemption_free == 16


def test_the_low_end_of_the_band_is_the_one_counted() -> None:
    assert LLAMA_8B is not None
    settings = engine(max_model_len=8192)
    plan = plan_replica(LLAMA_8B, 8.03, settings, Device.of(L4))
    band = replica_kv_band(LLAMA_8B, 8.03, settings, L4)
    assert band.blocks.low < plan.num_blocks < band.blocks.high
    assert concurrency(plan, band, CHAT).usable_blocks == band.blocks.low - 1


def test_the_recommendation_never_exceeds_vllms_default_and_is_zero_when_no_p95_sequence_fits() -> None:
    short = Workload(Tokens(10, 16), Tokens(10, 16), "test")
    assert _at(50_000, short).recommended == 256 == Device.of(L4).batch_defaults(1)[1]
    assert _at(320, CHAT).preemption_free == 0 and _at(320, CHAT).recommended == 0
    # One fits: it is recommended, however tight.
    assert (_at(321, CHAT).preemption_free, _at(321, CHAT).recommended) == (1, 1)


def test_a_trace_gives_each_sides_mean_and_nearest_rank_p95() -> None:
    assert percentile(list(range(1, 101))) == 95
    assert percentile([7]) == 7
    assert percentile([1, 2, 3, 100]) == 100
    profile = profile_of(list(range(1, 101)), [10] * 99 + [500], "t")
    assert (profile.prompt.mean, profile.prompt.p95) == (50.5, 95)
    assert (profile.output.mean, profile.output.p95) == (14.9, 10)


def test_without_a_profile_every_request_is_the_longest_the_limits_admit() -> None:
    assert full_length(8192, 6144, 2048, "d").p95_tokens == 8192
    # Limits wider than the context: the prompt limit, then what the context leaves for the answer.
    wide = full_length(8192, 8000, 4096, "d")
    assert (wide.prompt.p95, wide.output.p95, wide.mean_tokens) == (8000, 192, 8192)
    narrow = full_length(16384, 2048, 512, "d")
    assert (narrow.prompt.mean, narrow.output.mean) == (2048, 512)


# --- The `workload` block and the rule. ---


def _seventy(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        model = raw["models"][1]
        model["engine_overrides"].update(changes.pop("engine", {}))
        model["workload"].update(changes)

    return change


def test_prods_70b_runs_the_recommended_max_num_seqs_of_its_workload() -> None:
    (_, seventy) = plan_stack(capacity_input(parse(stack_sections("prod"))))
    at = seventy.concurrency
    assert at.workload.p95_tokens == 4096 + 1024 and at.workload.source == "its workload block"
    # The arithmetic the plan prints, from the band's low end.
    assert at.preemption_free == (seventy.kv_band.blocks.low - 1) // 320
    assert at.recommended == int(at.preemption_free * RECOMMENDED_SHARE)
    assert seventy.replica.engine.max_num_seqs == at.recommended == 14
    # The estimates are at that concurrency.
    assert seventy.decode is not None and seventy.decode.batch == 14


def test_a_max_num_seqs_that_would_preempt_at_p95_is_refused_in_one_line_naming_the_key() -> None:
    (_, seventy) = plan_stack(capacity_input(parse(stack_sections("prod"))))
    free = seventy.concurrency.preemption_free
    assert problems("prod", _seventy(engine={"max_num_seqs": free})) == []
    (line,) = problems("prod", _seventy(engine={"max_num_seqs": 128}))
    assert line.startswith(
        "config error: models[1].engine_overrides.max_num_seqs: 'llama-33-70b': 128 sequences at once would preempt "
        "at the workload's p95 (its workload block): "
    )
    assert "/ 320 per p95 sequence of 4,096 + 1,024 tokens = " in line and "workload.allow_preemption: true" in line


def test_with_a_workload_an_unset_max_num_seqs_is_judged_as_vllms_default() -> None:
    def unset(raw: dict[str, Any]) -> None:
        raw["models"][1]["engine_overrides"].pop("max_num_seqs")

    (line,) = problems("prod", unset)
    assert line.startswith(
        "config error: models[1].engine_overrides.max_num_seqs: 'llama-33-70b': unset, vLLM's default of 256 "
        "sequences at once would preempt at the workload's p95 (its workload block): "
    )

    def unset_and_accepted(raw: dict[str, Any]) -> None:
        unset(raw)
        raw["models"][1]["workload"]["allow_preemption"] = True

    assert problems("prod", unset_and_accepted) == []


def test_without_a_workload_vllms_default_is_shown_not_judged() -> None:
    def unset_without_workload(raw: dict[str, Any]) -> None:
        raw["models"][0].pop("workload")
        raw["models"][0]["engine_overrides"].pop("max_num_seqs")

    assert problems("prod", unset_without_workload) == []


def test_a_model_without_a_workload_is_planned_at_the_longest_requests() -> None:
    def bare(raw: dict[str, Any]) -> None:
        raw["models"][1].pop("workload")

    (line,) = problems("prod", bare)
    assert "(no workload given: every request at the longest serving.limits admits)" in line
    assert "/ 1,024 per p95 sequence of 12,288 + 4,096 tokens = " in line


def test_allow_preemption_turns_the_refusal_into_a_printed_warning() -> None:
    raw = copy.deepcopy(stack_sections("prod"))
    _seventy(engine={"max_num_seqs": 128}, allow_preemption=True)(raw)
    inputs = capacity_input(parse(raw))
    (eight, seventy) = plan_stack(inputs)
    warning = preemption_warning(seventy)
    free = seventy.concurrency.preemption_free
    assert warning == (
        f"preemption llama-33-70b: max_num_seqs 128 is above the {free} sequences the KV cache holds at once at "
        f"the workload's p95 (workload.allow_preemption: true): above {free} running sequences of long requests "
        f"vLLM preempts and recomputes them, and the preemption alerts take {free} as the load where it starts"
    )
    assert preemption_warning(eight) is None
    assert warning in text("prod", inputs, [eight, seventy]).splitlines()
    # The estimates run no more at once than the cache holds at the mean.
    assert seventy.decode is not None and seventy.decode.batch == seventy.concurrency.at_mean < 128
    assert preemption_free_sequences(parse(raw)) == {"llama-3.3-70b-instruct": free}


def test_the_plan_labels_its_figures_as_estimates_at_the_profile() -> None:
    inputs = capacity_input(parse(stack_sections("prod")))
    (_, seventy) = plan_stack(inputs)
    line = workload_line(seventy)
    assert line.startswith(
        "workload llama-33-70b: prompt 1,500 mean / 4,096 p95, output 300 mean / 1,024 p95 tokens "
        "(its workload block): no preemption up to "
    )
    assert "max_num_seqs 14 recommended (90% of " in line and ", set 14; estimates at this profile: ~" in line
    printed = stack_output(inputs, plan_stack(inputs))["models"]["llama-33-70b"]
    assert printed["workload"] == {
        "prompt_tokens": {"mean": 1500, "p95": 4096},
        "output_tokens": {"mean": 300, "p95": 1024},
        "source": "its workload block",
        "allow_preemption": False,
    }
    assert (printed["preemption_free_sequences"], printed["recommended_max_num_seqs"]) == (
        seventy.concurrency.preemption_free,
        14,
    )


@pytest.mark.parametrize(
    ("workload", "key", "message"),
    [
        (
            {"prompt_tokens": {"mean": 1500, "p95": 1000}, "output_tokens": {"mean": 300, "p95": 1024}},
            "workload.prompt_tokens",
            "p95 (1000) must be at least the mean (1500)",
        ),
        ({"prompt_tokens": {"mean": 1500, "p95": 4096}}, "workload", "give both prompt_tokens and output_tokens"),
        (
            {"prompt_tokens": {"mean": 9000, "p95": 16000}, "output_tokens": {"mean": 300, "p95": 1024}},
            "workload",
            "a p95 request of 16,000 prompt + 1,024 output = 17,024 tokens exceeds max_model_len 16,384",
        ),
    ],
)
def test_a_bad_workload_is_refused_in_one_line(workload: dict[str, Any], key: str, message: str) -> None:
    (line,) = problems("prod", lambda raw: raw["models"][1].update(workload=workload))
    assert line.startswith(f"config error: models[1].{key}: {message}")


def _trace(path: Path, lines: list[Any]) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_a_trace_of_usage_records_is_the_profile(tmp_path: Path) -> None:
    usage = [{"usage": {"prompt_tokens": 100 * i, "completion_tokens": 10 * i}} for i in range(1, 20)]
    # A bare usage object reads the same.
    trace = _trace(tmp_path / "t.jsonl", [*usage, {"prompt_tokens": 2000, "completion_tokens": 200}])
    raw = copy.deepcopy(stack_sections("prod"))
    raw["models"][1]["workload"] = {"trace": trace}
    (_, seventy) = plan_stack(capacity_input(parse(raw)))
    profile = seventy.concurrency.workload
    assert (profile.prompt.mean, profile.prompt.p95) == (1050, 1900)
    assert (profile.output.mean, profile.output.p95) == (105, 190)
    assert profile.source == f"trace {trace}, 20 requests"


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        (["{not json"], "line 1 is not JSON"),
        ([{"usage": {"prompt_tokens": 10}}], "line 1 has no usage with prompt_tokens (> 0) and completion_tokens"),
        ([{"prompt_tokens": 0, "completion_tokens": 3}], "line 1 has no usage"),
        ([""], "holds no request"),
    ],
)
def test_an_unreadable_trace_is_refused_naming_its_key(tmp_path: Path, lines: list[Any], why: str) -> None:
    trace = _trace(tmp_path / "bad.jsonl", lines)
    (line,) = problems("prod", lambda raw: raw["models"][1].update(workload={"trace": trace}))
    assert line.startswith(f"config error: models[1].workload.trace: {trace}: {why}")
    both = {"trace": _trace(tmp_path / "ok.jsonl", [{"prompt_tokens": 5, "completion_tokens": 5}])}
    (line,) = problems("prod", lambda raw: raw["models"][1]["workload"].update(both))
    assert line == "config error: models[1].workload: give prompt_tokens and output_tokens, or a trace, not both"
