"""The GitHub Actions workflows: actionlint-clean, and built the way the deploy flow needs.

Checks what a reviewer would otherwise have to re-check on every change:
each stack is previewed and deployed, one update per stack at a time, prod
only behind its environment, AWS only through OIDC, the policy pack on every
preview and update, least-privilege tokens, actions pinned to a major.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import STACKS

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
PULUMI_ACTION = "pulumi/actions"
AWS_ACTION = "aws-actions/configure-aws-credentials"
_MAJOR = re.compile(r"^[\w.-]+/[\w.-]+@(v\d+|[0-9a-f]{40})$")


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    # YAML 1.1 reads the bare key `on` as the boolean true.
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def workflows() -> dict[str, dict[str, Any]]:
    return {p.name: load(p.name) for p in sorted(WORKFLOWS.glob("*.yml"))}


def steps_using(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in job.get("steps", []) if str(s.get("uses", "")).split("@")[0] == action]


def pulumi_step(job: dict[str, Any]) -> dict[str, Any]:
    found = steps_using(job, PULUMI_ACTION)
    assert len(found) == 1, "one pulumi/actions step per job"
    step_with: dict[str, Any] = found[0]["with"]
    return step_with


def all_jobs() -> list[tuple[str, str, dict[str, Any]]]:
    return [(wf, name, job) for wf, doc in workflows().items() for name, job in doc["jobs"].items()]


def actionlint() -> str | None:
    beside = Path(sys.executable).parent / "actionlint"
    return str(beside) if beside.exists() else shutil.which("actionlint")


def test_actionlint_passes() -> None:
    binary = actionlint()
    if binary is None:
        pytest.skip("actionlint is not installed (make install-dev installs it)")
    # Files named explicitly: a copy of the project without .git is still checked.
    files = [str(p.relative_to(ROOT)) for p in sorted(WORKFLOWS.glob("*.yml"))]
    result = subprocess.run([binary, "-no-color", *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_three_flows_exist() -> None:
    assert {"preview.yml", "deploy.yml", "test.yml"} <= set(workflows())


# --- triggers --------------------------------------------------------------------------------


def test_triggers() -> None:
    docs = workflows()
    assert set(docs["preview.yml"]["on"]) == {"pull_request"}
    assert docs["deploy.yml"]["on"] == {"push": {"branches": ["main"]}}
    assert set(docs["test.yml"]["on"]) == {"pull_request", "push"}
    runs = [s.get("run", "") for s in docs["test.yml"]["jobs"]["test"]["steps"]]
    assert "bash .ci/run" in runs


# --- stacks ----------------------------------------------------------------------------------


def test_every_stack_is_previewed() -> None:
    job = load("preview.yml")["jobs"]["preview"]
    stacks = [entry["stack"] for entry in job["strategy"]["matrix"]["include"]]
    assert sorted(stacks) == STACKS
    with_ = pulumi_step(job)
    assert with_["command"] == "preview"
    assert with_["stack-name"] == "${{ matrix.stack }}"
    assert with_["diff"] is True
    assert with_["comment-on-pr"] is True


def test_every_stack_is_deployed_dev_first_prod_behind_its_environment() -> None:
    jobs = load("deploy.yml")["jobs"]
    stacks = {pulumi_step(job)["stack-name"]: name for name, job in jobs.items()}
    assert sorted(stacks) == STACKS
    assert all(pulumi_step(job)["command"] == "up" for job in jobs.values())
    prod = jobs[stacks["prod"]]
    assert prod["environment"] == "production"
    assert prod["needs"] == stacks["dev"]
    assert "environment" not in jobs[stacks["dev"]] or jobs[stacks["dev"]]["environment"] != "production"


@pytest.mark.parametrize("stack", STACKS)
def test_policy_pack_runs_with_the_stacks_config(stack: str) -> None:
    assert (ROOT / "policy" / "config" / f"{stack}.json").is_file()
    for wf, name, job in all_jobs():
        if not steps_using(job, PULUMI_ACTION):
            continue
        with_ = pulumi_step(job)
        assert with_["policyPacks"] == "policy", f"{wf}:{name}"
        stack_ref = with_["stack-name"]
        assert with_["policyPackConfigs"] == f"policy/config/{stack_ref}.json", f"{wf}:{name}"


# --- one update per stack --------------------------------------------------------------------


def test_deploys_hold_one_concurrency_group_per_stack() -> None:
    groups = {}
    for name, job in load("deploy.yml")["jobs"].items():
        stack = pulumi_step(job)["stack-name"]
        assert job["concurrency"] == {"group": f"pulumi-{stack}", "cancel-in-progress": False}, name
        groups[job["concurrency"]["group"]] = stack
    assert len(groups) == len(STACKS)


def test_previews_are_grouped_per_stack_and_pull_request() -> None:
    job = load("preview.yml")["jobs"]["preview"]
    group = job["concurrency"]["group"]
    assert "${{ matrix.stack }}" in group
    assert "${{ github.event.pull_request.number }}" in group
    # A preview never shares the deploys' group: a pending deploy would be
    # replaced by a queued preview.
    assert not group.startswith("pulumi-")


# --- credentials and permissions -------------------------------------------------------------


def test_aws_only_through_oidc() -> None:
    for wf, name, job in all_jobs():
        for step in steps_using(job, AWS_ACTION):
            assert job["permissions"].get("id-token") == "write", f"{wf}:{name}"
            with_ = step["with"]
            assert with_["role-to-assume"].startswith("${{ vars"), f"{wf}:{name}"
            assert not {"aws-access-key-id", "aws-secret-access-key"} & set(with_), f"{wf}:{name}"
    text = "\n".join(p.read_text() for p in WORKFLOWS.glob("*.yml"))
    assert "AWS_ACCESS_KEY_ID" not in text and "AWS_SECRET_ACCESS_KEY" not in text


def test_previews_assume_read_only_roles_and_deploys_deploy_roles() -> None:
    preview = load("preview.yml")["jobs"]["preview"]
    roles = {e["stack"]: e["role"] for e in preview["strategy"]["matrix"]["include"]}
    assert steps_using(preview, AWS_ACTION)[0]["with"]["role-to-assume"] == "${{ vars[matrix.role] }}"
    assert roles == {s: f"AWS_PREVIEW_ROLE_{s.upper()}" for s in STACKS}
    for job in load("deploy.yml")["jobs"].values():
        stack = pulumi_step(job)["stack-name"]
        role = steps_using(job, AWS_ACTION)[0]["with"]["role-to-assume"]
        assert role == f"${{{{ vars.AWS_DEPLOY_ROLE_{stack.upper()} }}}}"


def test_least_privilege_permissions() -> None:
    allowed_writes = {"id-token", "pull-requests"}
    for wf, doc in workflows().items():
        assert "permissions" in doc, f"{wf} sets no default permissions"
        top = doc["permissions"]
        assert top == {} or top == {"contents": "read"}, f"{wf}: {top}"
        for name, job in doc["jobs"].items():
            perms = job.get("permissions", top)
            assert isinstance(perms, dict), f"{wf}:{name}: {perms}"
            writes = {k for k, v in perms.items() if v == "write"}
            assert writes <= allowed_writes, f"{wf}:{name}: {writes}"
            if "id-token" in writes:
                assert steps_using(job, AWS_ACTION), f"{wf}:{name} asks for an OIDC token it does not use"
            if "pull-requests" in writes:
                assert pulumi_step(job).get("comment-on-pr") is True, f"{wf}:{name}"


def test_forks_do_not_get_cloud_credentials() -> None:
    job = load("preview.yml")["jobs"]["preview"]
    assert job["if"] == "github.event.pull_request.head.repo.full_name == github.repository"


# --- pins ------------------------------------------------------------------------------------


def test_actions_are_pinned_to_a_major() -> None:
    for wf, name, job in all_jobs():
        for step in job.get("steps", []):
            if "uses" in step:
                assert _MAJOR.match(step["uses"]), f"{wf}:{name}: {step['uses']}"
    for _, _, job in all_jobs():
        for step in steps_using(job, PULUMI_ACTION):
            assert re.fullmatch(r"pulumi/actions@v\d+", step["uses"])


def pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's exact pins."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==", 1) for line in lines if "==" in line)


def test_pulumi_cli_matches_the_sdk() -> None:
    program = pins(ROOT / "requirements.txt")
    # The pack runs beside the program under the same CLI.
    assert pins(ROOT / "policy" / "requirements.txt")["pulumi"] == program["pulumi"]
    for wf in ("preview.yml", "deploy.yml"):
        doc = load(wf)
        assert doc["env"]["PULUMI_VERSION"] == program["pulumi"], wf
        for _, job in doc["jobs"].items():
            assert pulumi_step(job)["pulumi-version"] == "${{ env.PULUMI_VERSION }}"
