"""The twin's command lines: every bad input gets one line and exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.render import ROOT
from tests.harness import stack_doc


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def one_line_error(done: subprocess.CompletedProcess[str], text: str) -> None:
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], done.stderr


def test_unknown_stack() -> None:
    done = run("-m", "infra.twin", "--stack", "staging")
    one_line_error(done, "twin: unknown stack 'staging': known stacks are dev, prod")


def test_a_stack_the_program_rejects(tmp_path: Path) -> None:
    doc = stack_doc("dev")
    doc["config"]["llm-platform:models"][0]["gpu_group"] = "no-such-group"
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = run("-m", "infra.twin", "--stack", "dev", "--config", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    assert "config error" in done.stderr and "no-such-group" in done.stderr
    assert not (tmp_path / "out" / "manifests.yaml").exists()


def test_a_missing_render_dir(tmp_path: Path) -> None:
    one_line_error(run("-m", "twin", "--render", str(tmp_path / "nope")), "does not exist")


def test_a_dir_that_is_not_a_render(tmp_path: Path) -> None:
    one_line_error(run("-m", "twin", "--render", str(tmp_path)), "not a render directory")


def test_a_render_without_ray_services(tmp_path: Path) -> None:
    (tmp_path / "manifests.yaml").write_text(yaml.safe_dump({"kind": "Namespace", "metadata": {"name": "x"}}))
    one_line_error(run("-m", "twin", "--render", str(tmp_path)), "holds no RayService")


def test_unreadable_manifests(tmp_path: Path) -> None:
    (tmp_path / "manifests.yaml").write_text("kind: [unclosed\n")
    one_line_error(run("-m", "twin", "--render", str(tmp_path)), "is not valid YAML")


def test_a_missing_stack_config(render_dirs: dict[str, Path], tmp_path: Path) -> None:
    done = run("-m", "twin", "--render", str(render_dirs["dev"]), "--stack-config", str(tmp_path / "x.yaml"))
    one_line_error(done, "does not exist")


def test_local_refuses_an_unknown_stack_and_a_bad_model_dir(tmp_path: Path) -> None:
    one_line_error(run("-m", "twin.local", "--stack", "staging", "--port", "1"), "unknown stack 'staging'")
    done = run("-m", "twin.local", "--stack", "dev", "--model-dir", str(tmp_path), "--port", "0")
    one_line_error(done, "is not a model directory")


@pytest.mark.usefixtures("needs_ray")
def test_static_checks_pass_on_the_committed_render_and_fail_on_the_bare_json(
    render_dirs: dict[str, Path], tmp_path: Path
) -> None:
    ok = run("-m", "twin", "--render", str(render_dirs["dev"]), "--stack", "dev", "--static-only")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS twin of dev" in ok.stdout
    docs = list(yaml.safe_load_all((render_dirs["dev"] / "manifests.yaml").read_text()))
    for doc in docs:
        if doc and doc.get("kind") == "RayService":
            for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
                if "resources" in group:
                    group.pop("resources")
                    group["rayStartParams"]["resources"] = '{"accelerator_type:L4": 1}'
    (tmp_path / "manifests.yaml").write_text(yaml.safe_dump_all(docs))
    bad = run("-m", "twin", "--render", str(tmp_path), "--stack", "dev", "--static-only")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "FAIL [llama-31-8b] ray start (gpu-llama-31-8b): UsageError: Got unexpected extra argument (1})" in bad.stdout
    )
    assert "FAIL twin of dev" in bad.stdout
