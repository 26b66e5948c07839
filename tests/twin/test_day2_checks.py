"""The day-2 checks that start nothing (twin/day2.py), as `python -m twin.day2 --static-only` prints them."""

from __future__ import annotations

import io

import pytest

from infra.render import render_document, stack_document
from tests.harness import render_stack
from twin import day2
from twin.report import Report


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_static_day2_checks_pass_on_the_committed_stacks(stack: str) -> None:
    out = io.StringIO()
    report = Report(out=out)
    before = render_stack(stack)
    assert day2.check_load_balancer_change(stack, before, report)
    assert day2.check_upgrade_at_peak(stack, report)
    assert day2.check_switches(stack, before, report)
    lines = out.getvalue().splitlines()
    assert report.ok_overall and not report.failed, "\n".join(lines)
    assert all(line.startswith("PASS") for line in lines), "\n".join(lines)
    assert any("refused before deploy" in line for line in lines)
    assert any("one node short, min: accepted" in line for line in lines)


def test_the_peak_check_fails_a_stack_sized_for_the_old_rule() -> None:
    """Sized for 2 x min (what prod had), the committed stack itself no longer loads: the check says so."""
    doc = stack_document("prod")
    for group in doc["config"]["llm-platform:node_groups"]["gpu"]:
        group["max_size"] = {"l40s-1x": 8, "l40s-4x": 4}.get(group["name"], group["max_size"])
    from infra.config import ConfigError

    with pytest.raises(ConfigError, match="no room for a NewCluster upgrade at peak"):
        render_document("prod", doc)


def test_the_cli_runs_the_static_checks_with_its_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert day2.main(["--stack", "dev", "--static-only"]) == 0
    out = capsys.readouterr().out
    assert "PASS day 2 of dev" in out


def test_upgrade_under_load_takes_only_a_ray_service_whose_models_keep_a_replica() -> None:
    """A woken model (vllm-server at min_replicas 0) has no serving pod for the upgrade's traffic: day 2 leaves
    it out of the live upgrade, and a stack with only such services says so instead of failing."""
    from tests.harness import manifests_of, render_routed

    (woken,) = manifests_of(render_routed("dev"), "RayService")
    assert day2._layout(woken) == "vllm-server" and not day2._stays_up(woken)
    assert all(day2._stays_up(rs) for rs in manifests_of(render_stack("prod"), "RayService"))
