"""Where the capacity plan shows: `python -m infra.plan`, the preview's lines, the `capacity` output,
the pull request's preview comment and docs/capacity.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import plan as plan_cli
from infra.capacity.geometry import PINNED
from infra.capacity.report import (
    ASSUMPTIONS,
    COLUMNS,
    ModelPlan,
    band_line,
    markdown,
    plan_stack,
    preview_line,
    stack_output,
    text,
    workload_line,
)
from infra.config import capacity_input, load_stack_file
from infra.render import ROOT, render
from tests.harness import STACKS, render_stack, stack_config

CAPACITY_PAGE = ROOT / "docs" / "capacity.md"
UPDATE_ENV = "UPDATE_DOCS_CAPACITY"


def config(stack: str) -> Any:
    return load_stack_file(ROOT / f"Pulumi.{stack}.yaml")


@pytest.mark.parametrize("stack", STACKS)
def test_every_example_model_fits_and_has_a_price(stack: str) -> None:
    cfg = config(stack)
    plans = plan_stack(capacity_input(cfg))
    assert [p.name for p in plans] == [m.name for m in cfg.models]
    for p, model in zip(plans, cfg.models, strict=True):
        assert p.replica.fits_one_sequence and 1 <= p.concurrency.recommended <= p.concurrency.preemption_free
        # A max_num_seqs the stack sets runs every sequence at the workload's p95 at once.
        assert not p.concurrency.preempts(p.replica.engine.max_num_seqs or 0)
        assert p.decode is not None and p.decode.tokens_per_second > 0
        assert p.cost.usd_per_hour is not None and p.cost.usd_per_million_tokens is not None
        assert p.cost.region == cfg.region
        assert p.cost.capacity_type == cfg.node_groups.gpu_group(model.gpu_group).capacity_type


@pytest.mark.parametrize("stack", STACKS)
def test_markdown_and_text_have_a_row_per_model_and_the_assumptions(stack: str) -> None:
    cfg = config(stack)
    inputs = capacity_input(cfg)
    plans = plan_stack(inputs)
    md = markdown(stack, inputs, plans).splitlines()
    assert md[0] == f"#### Capacity plan: `{stack}` ({cfg.region})"
    rows = [line for line in md if line.startswith("| ")]
    assert len(rows) == 1 + len(plans)
    assert all(line.count(" | ") == len(COLUMNS) - 1 for line in rows)
    assert all(f"- {a}" in md for a in ASSUMPTIONS)
    plain = text(stack, inputs, plans)
    assert all(p.name in plain for p in plans) and "est." in plain


def _assert_inside_its_printed_band(stack: str, inputs: Any, p: ModelPlan) -> None:
    """The replica's KV tokens lie inside its band, and the table, notes and output print that band."""
    band, tokens = p.kv_band.tokens, p.replica.kv_tokens
    assert band.low < tokens < band.high, (p.name, band, tokens)
    plans = plan_stack(inputs)
    assert f" {tokens:,} ({band.low:,}-{band.high:,}) " in markdown(stack, inputs, plans)
    assert band_line(p) in text(stack, inputs, plans).splitlines()
    # Each end names its assumption: the CUDA total it takes and the sampler copies behind its activations.
    assert "GiB to CUDA" in p.kv_band.low_assumption and "10.5 float32" in p.kv_band.low_assumption
    assert "GiB to CUDA" in p.kv_band.high_assumption and "9.0 float32" in p.kv_band.high_assumption
    printed = stack_output(inputs, plans)["models"][p.name]
    assert printed["kv_tokens"] == tokens
    assert printed["kv_tokens_band"] == {
        "low": band.low,
        "high": band.high,
        "low_assumption": p.kv_band.low_assumption,
        "high_assumption": p.kv_band.high_assumption,
    }


@pytest.mark.parametrize("stack", STACKS)
def test_every_models_kv_tokens_lie_inside_its_own_printed_band(stack: str) -> None:
    inputs = capacity_input(config(stack))
    plans = plan_stack(inputs)
    assert plans
    for p in plans:
        _assert_inside_its_printed_band(stack, inputs, p)


def test_kv_heads_fewer_than_tp_ranks_are_replicated_and_lie_inside_the_band() -> None:
    """prod's 70B at TP=4 with a geometry of 2 KV heads: each rank keeps one (vLLM's get_num_kv_heads)."""
    two_heads = PINNED[1].geometry.model_copy(update={"num_key_value_heads": 2}).model_dump()

    def edit(doc: dict[str, Any]) -> None:
        seventy = doc["llm-platform:models"][1]
        assert seventy["tensor_parallel_size"] == 4
        seventy["geometry"] = two_heads

    inputs = capacity_input(stack_config("prod", edit))
    p = plan_stack(inputs)[1]
    # 2 (K and V) x 80 layers x 1 KV head per rank x 128 x 2 bytes: half of the 8-head model's 2 heads per rank.
    assert p.replica.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert p.replica.engine.tensor_parallel_size > two_heads["num_key_value_heads"]
    _assert_inside_its_printed_band("prod", inputs, p)
    eight = plan_stack(capacity_input(config("prod")))[1]
    # The same memory holds twice the blocks at half the bytes a token.
    assert p.replica.num_blocks in (2 * eight.replica.num_blocks, 2 * eight.replica.num_blocks + 1)
    assert p.kv_band.tokens.low >= 2 * eight.kv_band.tokens.low


def test_the_labels_say_which_numbers_are_estimates() -> None:
    assert [c for c in COLUMNS if "est." in c] == ["decode (est. at workload)", "$/1M out (est. at workload)"]
    line = preview_line(plan_stack(capacity_input(config("dev")))[0])
    assert line.startswith("capacity llama-31-8b: 1 x L4 (g6.2xlarge, spot) in us-west-2: weights 15.0 GiB/GPU")
    assert "estimates at the workload profile: ~" in line


@pytest.mark.parametrize("stack", STACKS)
def test_the_capacity_output_is_the_plan(stack: str) -> None:
    cfg = config(stack)
    inputs = capacity_input(cfg)
    wanted = stack_output(inputs, plan_stack(inputs))
    got = render_stack(stack).outputs["capacity"]
    assert set(got["models"]) == {m.name for m in cfg.models}
    assert got["assumptions"] == wanted["assumptions"] and got["region"] == cfg.region
    for name, model in wanted["models"].items():
        # The render drops None values and writes whole floats as ints.
        assert got["models"][name] == {k: v for k, v in model.items() if v is not None}


def test_the_program_logs_one_line_per_model() -> None:
    # What the program logs through pulumi.log, as the mock engine hands it over.
    log = render("prod").log
    plans = plan_stack(capacity_input(config("prod")))
    assert [line for line in log if line.startswith("capacity ")] == [preview_line(p) for p in plans]
    assert [line for line in log if line.startswith("workload ")] == [workload_line(p) for p in plans]
    # prod keeps every max_num_seqs within its plan: no preemption warning.
    assert not [line for line in log if line.startswith("preemption ")]


def test_the_command_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["--stack", "prod", "--markdown"]) == 0
    inputs = capacity_input(config("prod"))
    assert capsys.readouterr().out == markdown("prod", inputs, plan_stack(inputs))
    assert plan_cli.main(["--stack", "dev"]) == 0
    assert capsys.readouterr().out.startswith("capacity plan: dev (us-west-2)\n")
    assert plan_cli.main(["--stack", "dev", "--json"]) == 0
    assert '"kv_tokens"' in capsys.readouterr().out


def test_the_command_exits_2_with_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    doc["config"]["llm-platform:models"][0]["max_model_len"] = 200_000
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert plan_cli.main(["--stack", "dev", "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "config error: models[0].max_model_len: 'llama-31-8b': 200,000 exceeds the model's context limit of "
        "131,072 tokens (max_position_embeddings)"
    ]
    assert plan_cli.main(["--stack", "nope"]) == 2


def test_the_preview_workflow_adds_the_plan_to_its_comment() -> None:
    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "preview.yml").read_text())
    steps = doc["jobs"]["preview"]["steps"]
    names = [s.get("name") or s.get("uses", "") for s in steps]
    plan_at = names.index("Capacity plan")
    comment_at = names.index("Add the capacity plan to the preview comment")
    pulumi_at = next(i for i, n in enumerate(names) if n.startswith("pulumi/actions"))
    assert plan_at < pulumi_at < comment_at
    assert 'venv/bin/python -m infra.plan --stack "${STACK}" --markdown > capacity-plan.md' in steps[plan_at]["run"]
    assert "$GITHUB_STEP_SUMMARY" in steps[plan_at]["run"]
    comment = steps[comment_at]
    assert comment["env"]["STACK"] == "${{ matrix.stack }}" and "capacity-plan.md" in comment["run"]
    # The heading pulumi/actions gives its comment, for this project.
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["name"]
    assert f"#### :tropical_drink: \\`preview\\` on {project}/${{STACK}}" in comment["run"]


# --- The plans of docs/capacity.md, generated from the stacks. ---


def _markers(stack: str) -> tuple[str, str]:
    return f"<!-- capacity plan: {stack} -->", f"<!-- end of capacity plan: {stack} -->"


def test_capacity_page_shows_the_plan_of_both_example_stacks() -> None:
    text_now = CAPACITY_PAGE.read_text()
    updated = text_now
    for stack in STACKS:
        begin, end = _markers(stack)
        assert updated.count(begin) == 1 and updated.count(end) == 1, f"docs/capacity.md lost the {stack} plan markers"
        head, rest = updated.split(begin)
        _, tail = rest.split(end)
        inputs = capacity_input(config(stack))
        updated = f"{head}{begin}\n{markdown(stack, inputs, plan_stack(inputs))}{end}{tail}"
    if os.environ.get(UPDATE_ENV) and not os.environ.get("CI"):
        CAPACITY_PAGE.write_text(updated)
        return
    assert text_now == updated, (
        "docs/capacity.md's plans are not the stacks' plans; rewrite them with "
        f"{UPDATE_ENV}=1 venv/bin/python -m pytest -q tests/test_capacity_report.py -k capacity_page"
    )
