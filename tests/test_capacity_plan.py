"""The capacity planner's arithmetic: geometry, GPU memory in bytes, vLLM's KV rules, the roofline and the prices.

tests/test_capacity_vllm.py holds the same numbers to vLLM's own code; these
tests pin the rules that code implies, without vLLM.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from infra.capacity.calibration import CUDA_MEMORY, overhead_band
from infra.capacity.cost import BANDWIDTH_EFFICIENCY, decode_estimate, nodes_share, replica_cost
from infra.capacity.geometry import PINNED, Geometry, pinned_model, resolve_geometry
from infra.capacity.kv_band import replica_kv_band
from infra.capacity.plan import (
    GIB,
    Device,
    EngineSettings,
    overheads,
    plan_replica,
    pp_layers,
    run_of,
    stages,
)
from infra.capacity.prices import PRICES, price
from infra.capacity.workload import Tokens, Workload, concurrency
from infra.instance_types import GB, GPU_INSTANCE_TYPES
from tests.harness import engine
from workloads.inference_server.catalog import ModelEntry

LLAMA_8B = resolve_geometry(None, "s3://b/meta-llama/Llama-3.1-8B-Instruct", "x")
LLAMA_70B = resolve_geometry(None, "s3://b/meta-llama/Llama-3.3-70B-Instruct", "x")
L4 = Device.of(GPU_INSTANCE_TYPES["g6.2xlarge"])
L40S = Device.of(GPU_INSTANCE_TYPES["g6e.12xlarge"])
# A chat profile: 4,096 + 1,024 tokens at p95 (320 blocks of 16), 1,500 + 300 at the mean.
CHAT = Workload(Tokens(1500, 4096), Tokens(300, 1024), "test")


def test_pinned_families_are_found_by_source_or_model_id() -> None:
    assert LLAMA_8B is not None and LLAMA_70B is not None
    assert pinned_model("s3://bucket/meta-llama/Llama-3.1-8B-Instruct/", "anything") is PINNED[0]
    assert pinned_model("s3://bucket/weights/v3", "llama-3.3-70b-instruct") is PINNED[1]
    assert pinned_model("/models/Meta-Llama-3.1-8B", "m") is PINNED[0]
    assert pinned_model("s3://bucket/acme/mystery-7b", "mystery-7b") is None
    own = replace(PINNED[0]).geometry.model_copy(update={"num_hidden_layers": 2})
    assert resolve_geometry(own, "s3://bucket/meta-llama/Llama-3.1-8B-Instruct", "x") is own


def test_pinned_entries_cite_their_config_and_count_their_parameters() -> None:
    for pinned in PINNED:
        assert pinned.source.startswith("https://huggingface.co/" + pinned.hub_id)
        assert pinned.source.endswith("config.json")
        g = pinned.geometry
        layer = 2 * g.hidden_size * g.num_attention_heads * g.head_dim
        layer += 2 * g.hidden_size * g.num_key_value_heads * g.head_dim
        layer += 3 * g.hidden_size * g.intermediate_size + 2 * g.hidden_size
        counted = g.num_hidden_layers * layer + g.vocab_parameters + g.hidden_size
        assert counted == pinned.parameters


def test_geometry_refuses_kv_heads_that_do_not_group_the_heads() -> None:
    assert LLAMA_8B is not None
    with pytest.raises(ValidationError, match="num_key_value_heads"):
        Geometry(**{**LLAMA_8B.model_dump(), "num_key_value_heads": 5})


def test_instance_types_hold_the_datasheets_gb_not_gib() -> None:
    l4 = GPU_INSTANCE_TYPES["g6.2xlarge"]
    assert l4.gpu_memory_bytes == 24 * 10**9
    # The old reading, 24 GiB, was 7.4% more than the card has.
    assert 24 * GIB / l4.gpu_memory_bytes == pytest.approx(1.0737, abs=1e-4)
    for gpu in GPU_INSTANCE_TYPES.values():
        assert gpu.gpu_memory_bytes == gpu.gpu_memory_gb * GB
        assert gpu.memory_bandwidth_bytes_s >= 300 * GB


def test_the_plans_gpu_memory_is_the_lower_total_cuda_reports() -> None:
    # What gpu_memory_utilization is a share of: 21.99 GiB on an L4, not its datasheet's 24 GB.
    assert L4.memory_bytes == 23_612_293_120 < GPU_INSTANCE_TYPES["g6.2xlarge"].gpu_memory_bytes
    for gpu in GPU_INSTANCE_TYPES.values():
        assert Device.of(gpu).memory_bytes == CUDA_MEMORY[gpu.ray_accelerator_type].low_bytes


def test_pipeline_stages_split_the_layers_as_vllm_does() -> None:
    assert pp_layers(32, 1) == [32]
    assert pp_layers(80, 3) == [27, 27, 26]
    # The remainder goes to the stages before the last, from the back.
    assert pp_layers(32, 5) == [6, 6, 7, 7, 6]
    assert pp_layers(10, 4) == [2, 3, 3, 2]


def test_kv_bytes_per_token_follow_heads_layers_dtype_and_tp() -> None:
    assert LLAMA_8B is not None and LLAMA_70B is not None
    kv = lambda g, **c: [s.kv_bytes_per_token for s in stages(g, 8.03e9, engine(**c), L40S)]  # noqa: E731
    # 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes.
    assert kv(LLAMA_8B) == [2 * 32 * 8 * 128 * 2] == [131072]
    assert kv(LLAMA_8B, kv_cache_dtype="fp8") == [65536]
    assert kv(LLAMA_8B, dtype="float32") == [262144]
    assert kv(LLAMA_70B, tensor_parallel_size=4) == [2 * 80 * 2 * 128 * 2]
    # More TP ranks than KV heads: each rank keeps one (replicated).
    assert kv(LLAMA_8B, tensor_parallel_size=16) == [2 * 32 * 1 * 128 * 2]
    split = kv(LLAMA_70B, tensor_parallel_size=4, pipeline_parallel_size=3)
    assert split == [2 * n * 2 * 128 * 2 for n in (27, 27, 26)]


def test_weights_split_over_the_gpus_of_a_replica() -> None:
    assert LLAMA_70B is not None
    one = stages(LLAMA_70B, 70.6e9, engine(), L40S)
    four = stages(LLAMA_70B, 70.6e9, engine(tensor_parallel_size=4), L40S)
    split = stages(LLAMA_70B, 70.6e9, engine(tensor_parallel_size=4, pipeline_parallel_size=2), L40S)
    assert one[0].weight_bytes == pytest.approx(70.6e9 * 2, rel=1e-4)
    assert four[0].weight_bytes * 4 == pytest.approx(one[0].weight_bytes, rel=1e-4)
    assert sum(s.weight_bytes for s in split) * 4 == pytest.approx(one[0].weight_bytes, rel=1e-4)
    fp8 = stages(LLAMA_70B, 70.6e9, engine(quantization="fp8"), L40S)[0].weight_bytes
    # Layers in one byte, the embedding and LM head stay in bfloat16.
    assert fp8 == pytest.approx(70.6e9 + LLAMA_70B.vocab_parameters + LLAMA_70B.hidden_size, rel=1e-4)


def test_kv_memory_is_what_the_gpu_leaves_after_weights_and_profiled_overheads() -> None:
    assert LLAMA_8B is not None
    plan = plan_replica(LLAMA_8B, 8.03, engine(), L4)
    stage = plan.stages[0]
    spent = stage.weight_bytes + plan.overheads.total
    assert stage.kv_memory_bytes == -(-23_612_293_120 * 9 // 10) - spent
    assert plan.num_blocks == stage.kv_memory_bytes // (16 * 131072)
    eager = plan_replica(LLAMA_8B, 8.03, engine(enforce_eager=True), L4)
    assert eager.overheads.cuda_graph_bytes == 0 < plan.overheads.cuda_graph_bytes
    assert eager.stages[0].kv_memory_bytes - stage.kv_memory_bytes == plan.overheads.cuda_graph_bytes
    # On an L4 the sampler's warm-up (256 rows of logits) is the peak, so fewer sequences leave more memory.
    fewer = overheads(LLAMA_8B, engine(max_num_seqs=64), L4).activation_bytes
    assert fewer < plan.overheads.activation_bytes
    # With few sequences the forward pass is the peak: it grows with the tokens of the profiling pass.
    small = overheads(LLAMA_8B, engine(max_num_seqs=8, max_num_batched_tokens=1024), L4).activation_bytes
    assert small < overheads(LLAMA_8B, engine(max_num_seqs=8), L4).activation_bytes


def test_each_overhead_is_the_midpoint_of_the_calibrated_band() -> None:
    assert LLAMA_70B is not None
    settings = engine(tensor_parallel_size=4, max_num_seqs=128)
    band = overhead_band(LLAMA_70B, run_of(settings, L40S))
    got = overheads(LLAMA_70B, settings, L40S)
    assert got.activation_bytes == (band.activation.low + band.activation.high) // 2
    assert got.non_torch_bytes == (band.non_torch.low + band.non_torch.high) // 2
    assert got.cuda_graph_bytes == (band.cuda_graphs.low + band.cuda_graphs.high) // 2
    # No separate NCCL allowance (vLLM sets NCCL up before it measures): under the old plan's 1 GiB at TP=4.
    assert got.non_torch_bytes < GIB


def test_only_the_last_pipeline_stage_pays_for_the_sampler() -> None:
    assert LLAMA_70B is not None
    settings = engine(tensor_parallel_size=4, pipeline_parallel_size=2)
    first, last = stages(LLAMA_70B, 70.6e9, settings, L40S)
    first_over = overheads(LLAMA_70B, settings, L40S, last_stage=False)
    last_over = overheads(LLAMA_70B, settings, L40S)
    assert first_over.activation_bytes < last_over.activation_bytes
    requested = -(-L40S.memory_bytes * 9 // 10)
    assert first.kv_memory_bytes == requested - first.weight_bytes - first_over.total
    assert last.kv_memory_bytes == requested - last.weight_bytes - last_over.total


@pytest.mark.parametrize(("name", "tokens", "seqs"), [("L4", 2048, 256), ("A100", 2048, 256), ("H100", 8192, 1024)])
def test_batch_defaults_are_vllms_for_the_openai_server(name: str, tokens: int, seqs: int) -> None:
    gpu = next(g for g in GPU_INSTANCE_TYPES.values() if g.gpu_model == name)
    assert Device.of(gpu).batch_defaults(1) == (tokens, seqs)


def test_kv_cache_memory_bytes_sets_the_cache_as_vllm_takes_it() -> None:
    assert LLAMA_8B is not None
    block = 16 * 131072
    plan = plan_replica(LLAMA_8B, 8.03, engine(kv_cache_memory_bytes=100 * block + 5), L4)
    assert plan.overheads.total == 0
    assert plan.num_blocks == 100
    # vLLM logs int(blocks / ceil(max_model_len / block_size) x max_model_len).
    assert plan.kv_tokens == int(100 / 512 * 8192) == 1600
    odd = plan_replica(LLAMA_8B, 8.03, engine(kv_cache_memory_bytes=100 * block, max_model_len=1000), L4)
    assert odd.blocks_per_sequence == 63 and odd.kv_tokens == int(100 / 63 * 1000)


def test_one_sequence_fits_only_beside_the_null_block() -> None:
    assert LLAMA_8B is not None
    block = 16 * 131072
    just = plan_replica(LLAMA_8B, 8.03, engine(kv_cache_memory_bytes=513 * block), L4)
    short = plan_replica(LLAMA_8B, 8.03, engine(kv_cache_memory_bytes=513 * block - 1), L4)
    assert (just.fits_one_sequence, just.max_model_len_sequences) == (True, 1)
    assert (short.fits_one_sequence, short.max_model_len_sequences) == (False, 0)


def test_fp8_kv_cache_holds_twice_the_tokens() -> None:
    assert LLAMA_70B is not None
    base = plan_replica(LLAMA_70B, 70.6, engine(tensor_parallel_size=4, max_model_len=16384), L40S)
    fp8 = plan_replica(LLAMA_70B, 70.6, engine(tensor_parallel_size=4, max_model_len=16384, kv_cache_dtype="fp8"), L40S)
    assert fp8.num_blocks in (2 * base.num_blocks, 2 * base.num_blocks + 1)


def test_engine_settings_read_the_engine_overrides() -> None:
    entry = ModelEntry(
        model_id="m",
        source="s3://bucket/m",
        max_model_len=4096,
        engine_overrides={"kv_cache_dtype": "fp8", "block_size": 32, "max_num_seqs": 64, "enforce_eager": True},
    )
    settings = EngineSettings.of(entry)
    assert (settings.kv_cache_dtype, settings.block_size, settings.max_num_seqs) == ("fp8", 32, 64)
    assert settings.enforce_eager and settings.kv_value_bytes() == 1
    assert EngineSettings.of(entry.model_copy(update={"engine_overrides": {}})).kv_value_bytes() == 2


def test_decode_roofline_reads_weights_and_the_batchs_kv_each_step() -> None:
    assert LLAMA_8B is not None
    settings = engine(max_model_len=16384)
    plan = plan_replica(LLAMA_8B, 8.03, settings, L40S)
    at = concurrency(plan, replica_kv_band(LLAMA_8B, 8.03, settings, GPU_INSTANCE_TYPES["g6e.12xlarge"]), CHAT)
    decode = decode_estimate(plan, at)
    assert decode is not None
    # At the recommended max_num_seqs, each sequence holding the mean prompt and half the mean answer.
    assert decode.batch == at.recommended and decode.context_tokens == 1500 + 300 // 2
    moved = plan.stages[0].weight_bytes + decode.batch * 1650 * 131072
    assert decode.bytes_per_step == moved
    assert decode.tokens_per_second == pytest.approx(decode.batch * 864 * GB * BANDWIDTH_EFFICIENCY / moved)
    capped = decode_estimate(replace(plan, engine=replace(plan.engine, max_num_seqs=2)), at)
    assert capped is not None and capped.batch == 2 and capped.tokens_per_second < decode.tokens_per_second
    # A max_num_seqs above what the cache holds at the mean runs only that many at once.
    crowded = decode_estimate(replace(plan, engine=replace(plan.engine, max_num_seqs=10_000)), at)
    assert crowded is not None and crowded.batch == at.at_mean


def test_cost_is_the_replicas_share_of_its_nodes_at_the_pinned_price() -> None:
    assert LLAMA_8B is not None
    g6e = GPU_INSTANCE_TYPES["g6e.12xlarge"]
    assert nodes_share(4, g6e) == 1 and nodes_share(1, g6e) == 0.25 and nodes_share(8, g6e) == 2
    plan = plan_replica(LLAMA_8B, 8.03, engine(), L40S)
    decode = decode_estimate(plan, concurrency(plan, replica_kv_band(LLAMA_8B, 8.03, engine(), g6e), CHAT))
    cost = replica_cost(plan, g6e, "on_demand", "us-east-1", decode)
    assert cost.price is not None and cost.usd_per_hour == pytest.approx(10.49264 / 4)
    assert decode is not None and cost.usd_per_million_tokens == pytest.approx(
        cost.usd_per_hour / (decode.tokens_per_second * 3600) * 1e6
    )
    nowhere = replica_cost(plan, g6e, "spot", "eu-west-1", decode)
    assert (nowhere.usd_per_hour, nowhere.usd_per_million_tokens) == (None, None)


def test_every_price_carries_its_date_and_source_and_is_below_on_demand_when_spot() -> None:
    assert PRICES
    for (region, name, kind), pinned in PRICES.items():
        assert name in GPU_INSTANCE_TYPES and region.count("-") == 2
        assert pinned.as_of[:4].isdigit() and pinned.source and pinned.usd_per_hour > 0
        if kind == "spot":
            on_demand = price(region, name, "on_demand")
            assert on_demand is not None and pinned.usd_per_hour < on_demand.usd_per_hour
