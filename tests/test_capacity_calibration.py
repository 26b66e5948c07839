"""The KV band against what vLLM logs: sourced CUDA totals, published start-ups in their bands, NCCL counted once."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from infra.capacity.calibration import (
    CALIBRATION_POINTS,
    CUDA_MEMORY,
    MODELLED_SINCE,
    CalibrationPoint,
    Run,
    cuda_graph_count,
    cuda_memory,
    overhead_band,
    version,
)
from infra.capacity.geometry import PINNED, Geometry
from infra.capacity.kv_band import replica_kv_band
from infra.capacity.plan import GIB, Device, plan_replica
from infra.instance_types import GPU_INSTANCE_TYPES
from tests.harness import engine

# vLLM logs GiB with two decimals: a logged figure is its true value within half of 0.01 GiB, and a sum
# of two logged figures within 0.01 GiB.
ROUNDING = 0.01 * GIB
LLAMA_8B, LLAMA_70B = PINNED[0].geometry, PINNED[1].geometry


def point(model: str, tp: int = 1) -> CalibrationPoint:
    return next(p for p in CALIBRATION_POINTS if p.model == model and p.tensor_parallel_size == tp)


# --- the CUDA totals -------------------------------------------------------------------------------------------


def test_every_gpu_of_the_instance_types_has_a_cuda_total() -> None:
    assert set(CUDA_MEMORY) == {gpu.ray_accelerator_type for gpu in GPU_INSTANCE_TYPES.values()}
    for name, gpu in GPU_INSTANCE_TYPES.items():
        entry = cuda_memory(gpu)
        assert 0 < entry.low_bytes <= entry.high_bytes, name
        assert entry.sources or entry.assumption, f"{name}: neither a source nor the assumption standing in"


def _figures(quote: str) -> set[float]:
    """Every number a quote states, as bytes: plain byte counts, and GiB figures with two decimals."""
    found = {float(m) for m in re.findall(r"\b\d{10,}\b", quote)}
    return found | {float(m) * GIB for m in re.findall(r"(\d+\.\d\d) ?GiB", quote)}


def test_each_sourced_end_is_the_figure_its_source_states() -> None:
    for name, entry in CUDA_MEMORY.items():
        if not entry.sources:
            assert entry.assumption.startswith("no ") and entry.low_bytes == entry.high_bytes, name
            continue
        assert all(s.url.startswith("https://github.com/") and s.quote for s in entry.sources), name
        stated = set().union(*(_figures(s.quote) for s in entry.sources))
        for end in (entry.low_bytes, entry.high_bytes):
            assert any(abs(end - figure) <= ROUNDING / 2 for figure in stated), f"{name}: {end} is in no quote"


def test_the_gddr6_cards_report_less_than_their_datasheet() -> None:
    """What gpu_memory_utilization multiplies: about 22.0 GiB on an L4 and 44.5 GiB on an L40S, not 24 and 48 GB."""
    datasheet = {gpu.ray_accelerator_type: gpu.gpu_memory_bytes for gpu in GPU_INSTANCE_TYPES.values()}
    for name in ("L4", "A10G", "L40S"):
        assert CUDA_MEMORY[name].high_bytes < datasheet[name], name
    assert CUDA_MEMORY["L4"].low_bytes / GIB == pytest.approx(22.0, abs=0.1)
    assert CUDA_MEMORY["L40S"].high_bytes / GIB == pytest.approx(44.5, abs=0.1)


# --- the calibration points ------------------------------------------------------------------------------------


def test_the_points_name_their_run_and_cover_tensor_parallelism() -> None:
    assert len(CALIBRATION_POINTS) >= 5
    assert any(p.tensor_parallel_size > 1 for p in CALIBRATION_POINTS)
    for p in CALIBRATION_POINTS:
        assert version(p.vllm) >= MODELLED_SINCE, f"{p.model}: vLLM {p.vllm} budgets NCCL differently"
        assert p.gpu in CUDA_MEMORY and p.source.url.startswith("https://github.com/") and p.settings
        assert str(p.kv_cache_gib) in p.source.quote and str(p.weights_gib) in p.source.quote, p.model


def test_every_point_logs_a_kv_memory_inside_its_band() -> None:
    for p in CALIBRATION_POINTS:
        band = p.band()
        assert band.holds(p.kv_cache_gib * GIB, slack=ROUNDING), (p.model, band.low / GIB, band.high / GIB)


def test_the_logged_activation_and_non_torch_memory_fall_in_their_own_bands() -> None:
    checked = 0
    for p in CALIBRATION_POINTS:
        over = overhead_band(p.geometry, p.run)
        if p.activation_gib is not None:
            assert over.activation.holds(p.activation_gib * GIB, slack=ROUNDING), p.model
            checked += 1
        if p.non_torch_gib is not None:
            assert over.non_torch.holds(p.non_torch_gib * GIB, slack=ROUNDING), p.model
    assert checked >= 4


def test_the_budget_is_the_share_of_the_total_less_what_profiling_measured() -> None:
    """vLLM 0.11's own arithmetic in its logs: ceil(total x utilization) - weights - activations - non-torch = KV."""
    for p in CALIBRATION_POINTS:
        if p.startup_total_gib is None or p.activation_gib is None or p.non_torch_gib is None:
            continue
        measured = p.weights_gib + p.activation_gib + p.non_torch_gib
        assert p.startup_total_gib * p.gpu_memory_utilization - measured == pytest.approx(p.kv_cache_gib, abs=0.03)


def test_nccl_set_up_before_the_snapshot_is_not_counted_again() -> None:
    """At TP=2 the communicators took 0.93 GiB before vLLM's snapshot; its budget never saw them.

    The non-torch memory vLLM measured grew by only 0.42 GiB over TP=1's. An overhead model that added
    the communicators (or a separate NCCL allowance, as the plan's 512 MiB) would put its low end above that.
    """
    tp1, tp2 = point("meta-llama/Llama-3.1-8B-Instruct"), point("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 2)
    assert tp1.startup_total_gib and tp1.startup_free_gib and tp2.startup_total_gib and tp2.startup_free_gib
    assert tp1.non_torch_gib is not None and tp2.non_torch_gib is not None
    before_snapshot = (tp2.startup_total_gib - tp2.startup_free_gib) - (tp1.startup_total_gib - tp1.startup_free_gib)
    measured = tp2.non_torch_gib - tp1.non_torch_gib
    assert measured < before_snapshot
    alone, parallel = overhead_band(LLAMA_8B, tp1.run).non_torch, overhead_band(LLAMA_70B, tp2.run).non_torch
    assert parallel.low - alone.low <= measured * GIB <= parallel.high - alone.high


def test_logged_tokens_follow_from_the_logged_memory_by_the_plans_rules() -> None:
    p = next(p for p in CALIBRATION_POINTS if p.kv_tokens is not None)
    settings = engine(max_model_len=p.max_model_len, kv_cache_memory_bytes=round(p.kv_cache_gib * GIB))
    device = Device.of(GPU_INSTANCE_TYPES["p4d.24xlarge"])
    assert plan_replica(p.geometry, 8.03, settings, device).kv_tokens == p.kv_tokens


# --- the overhead model ----------------------------------------------------------------------------------------


def test_cuda_graphs_are_counted_as_vllm_captures_and_subtracts_them() -> None:
    # vLLM's logs: "PIECEWISE=51 (largest=512), FULL=35 (largest=256)" at max_num_seqs 256,
    # "PIECEWISE=35 (largest=256), FULL=19 (largest=128)" at 128 (vllm-project/vllm#39610).
    assert cuda_graph_count(Run(2048, 256)) == 51 + 35
    assert cuda_graph_count(Run(2048, 128)) == 35 + 19
    run = Run(2048, 256)
    assert overhead_band(LLAMA_8B, run).cuda_graphs.low > 0
    assert overhead_band(LLAMA_8B, replace(run, enforce_eager=True)).cuda_graphs.high == 0
    assert overhead_band(LLAMA_8B, replace(run, vllm=(0, 20))).cuda_graphs.high == 0


def test_the_sampler_warms_up_on_the_last_pipeline_stage_only() -> None:
    run = Run(2048, 256, pipeline_parallel_size=2)
    first, last = overhead_band(LLAMA_70B, run, last_stage=False), overhead_band(LLAMA_70B, run)
    assert first.activation.high < last.activation.low
    # The last stage's peak is the sampler's: max_num_seqs rows of float32 logits, copied about ten times.
    assert last.activation.low == int(256 * LLAMA_70B.vocab_size * 4 * 9.0)


# --- the stacks' models ----------------------------------------------------------------------------------------


def test_devs_8b_on_an_l4_holds_what_vllm_would_log() -> None:
    """Pulumi.dev.yaml: Llama 3.1 8B, max_model_len 8192, utilization 0.9, one L4; vLLM logs about 21,000 tokens."""
    band = replica_kv_band(LLAMA_8B, 8.03, engine(), GPU_INSTANCE_TYPES["g6.2xlarge"])
    assert band.tokens.holds(21_000)
    assert band.tokens.low < band.tokens.high
    assert "21.99 GiB" in band.low_assumption and "10.5 float32" in band.low_assumption
    assert "9.0 float32" in band.high_assumption and band.describe().startswith(f"{band.tokens.low:,}-")


def test_prods_models_on_l40s_hold_what_vllm_would_log() -> None:
    """Pulumi.prod.yaml's 70B at TP=4, utilization 0.92, as it ran before its workload profile (max_num_seqs 128):
    the old plan's 78,432 was ~15% low."""
    seventy = engine(max_model_len=16384, gpu_memory_utilization=0.92, tensor_parallel_size=4, max_num_seqs=128)
    band = replica_kv_band(LLAMA_70B, 70.6, seventy, GPU_INSTANCE_TYPES["g6e.12xlarge"])
    assert band.tokens.holds(78_432 * 1.15)
    eight = replica_kv_band(LLAMA_8B, 8.03, engine(max_model_len=16384), GPU_INSTANCE_TYPES["g6e.2xlarge"])
    assert eight.tokens.low > band.tokens.high  # one L40S for 8B weights leaves more than a quarter-70B


def test_band_tokens_follow_the_plans_kv_rules_when_kv_heads_are_fewer_than_tp_ranks() -> None:
    # A model whose 4 KV heads are replicated over 8 TP ranks (ModelConfig.get_num_kv_heads: one per rank).
    four_heads = Geometry(**{**LLAMA_70B.model_dump(), "num_key_value_heads": 4})
    settings = engine(max_model_len=16384, tensor_parallel_size=8)
    gpu = GPU_INSTANCE_TYPES["g6e.48xlarge"]
    band = replica_kv_band(four_heads, 70.0, settings, gpu)
    for end in ("low", "high"):
        given = replace(settings, kv_cache_memory_bytes=band.memory.end(end))
        assert plan_replica(four_heads, 70.0, given, Device.of(gpu)).kv_tokens == band.tokens.end(end)
    assert 0 < band.tokens.low < band.tokens.high


def test_kv_cache_memory_bytes_is_taken_as_given() -> None:
    settings = engine(kv_cache_memory_bytes=4 * GIB)
    band = replica_kv_band(LLAMA_8B, 8.03, settings, GPU_INSTANCE_TYPES["g6.2xlarge"])
    assert band.memory.low == band.memory.high == 4 * GIB
    assert band.tokens.low == band.tokens.high
