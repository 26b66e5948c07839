"""checkov over the rendered manifests of both stacks and the pods KubeRay builds from the RayServices.

checkov reads Kubernetes objects it knows; a RayService is a custom
resource whose pods it never sees, so each RayService's head and worker
pods are written out as Pods too (tests.harness.ray_service_pods: the
templates plus what KubeRay adds). A failed check is allowed only where the
object carries `checkov.io/skip<N>: <CHECK_ID>=<reason>`, which checkov
itself reports as skipped with that reason.

checkov runs offline: `--skip-download` keeps it from fetching guidelines
or policies, and no API key is given. It lives in a venv of its own
(venv/checkov, see requirements-checkov.txt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import Gateway
from infra.serving.router import router_name
from tests.harness import manifests_of, ray_service_pods, render_routed, render_stack

# The gateway's name when `serving.gateway` leaves it at its default.
GATEWAY_NAME = Gateway().name

STACKS = ["dev", "prod"]
CHECKOV_VARIABLE = "CHECKOV_BIN"
TIME_BUDGET_SECONDS = 60


def checkov_binary() -> str:
    """checkov from $CHECKOV_BIN, the venv beside this one, or PATH; skip (fail under CI) without it."""
    candidates = [os.environ.get(CHECKOV_VARIABLE), str(Path(sys.prefix) / "checkov" / "bin" / "checkov")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("checkov")
    if found:
        return found
    message = "checkov is not installed: run scripts/install-test-deps.sh (it makes venv/checkov)"
    if os.environ.get("CI", "").lower() in {"true", "1"}:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def _write(path: Path, objects: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))


def routed_objects() -> list[dict[str, Any]]:
    """What prod's routed render adds to prod's (tests.harness.ROUTING, GATEWAY): each model's router and its
    front, and the gateway with its load balancer's Service. The prod objects themselves are checked above."""

    def key(m: dict[str, Any]) -> tuple[str, str]:
        return m["kind"], m["metadata"]["name"]

    committed = {key(m) for m in render_stack("prod").manifests}
    return [m for m in render_routed("prod").manifests if key(m) not in committed and m["kind"] != "PodMonitor"]


def checkov_report(tmp: str) -> tuple[dict[str, Any], float]:
    """One checkov run over both stacks: (report, seconds)."""
    binary = checkov_binary()
    root = Path(tmp)
    for stack in STACKS:
        rendered = render_stack(stack)
        (root / stack).mkdir(parents=True, exist_ok=True)
        _write(root / stack / "manifests.yaml", rendered.manifests)
        pods = [pod for rs in manifests_of(rendered, "RayService") for pod in ray_service_pods(rs)]
        _write(root / stack / "ray-service-pods.yaml", pods)
    # The routers and the model gateway, off in both stacks: prod's routed render has them.
    (root / "prod-routed").mkdir(parents=True, exist_ok=True)
    _write(root / "prod-routed" / "manifests.yaml", routed_objects())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BC_", "PRISMA_", "CKV_"))}
    started = time.monotonic()
    run = subprocess.run(
        [
            binary,
            "--directory",
            str(root),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--compact",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert run.returncode in (0, 1), f"checkov failed to run ({run.returncode}): {run.stderr[-2000:]}"
    report = json.loads(run.stdout)
    if isinstance(report, list):  # one report per framework when several ran
        (report,) = [r for r in report if r.get("check_type") == "kubernetes"]
    assert isinstance(report, dict)
    return report, elapsed


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    found, elapsed = checkov_report(str(tmp_path_factory.mktemp("checkov")))
    assert elapsed < TIME_BUDGET_SECONDS, f"checkov took {elapsed:.0f} s"
    return found


def _results(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = report["results"].get(kind, [])
    return results


def test_no_failed_check(report: dict[str, Any]) -> None:
    failed = [
        f"{r['check_id']} {r['check_name']}: {r['resource']} ({r['file_path']})"
        for r in _results(report, "failed_checks")
    ]
    assert failed == [], "checkov failures (fix them, or annotate checkov.io/skip<N>: <ID>=<reason>):\n" + "\n".join(
        failed
    )
    assert report["summary"]["parsing_errors"] == 0


def test_every_skip_says_why(report: dict[str, Any]) -> None:
    for r in _results(report, "skipped_checks"):
        reason = r["check_result"].get("suppress_comment") or ""
        assert len(reason.split()) >= 5, f"{r['check_id']} on {r['resource']} is skipped without a reason"


def test_checkov_saw_the_ray_pods_and_the_serving_workloads(report: dict[str, Any]) -> None:
    resources = {r["resource"] for kind in ("passed_checks", "skipped_checks") for r in _results(report, kind)}
    for stack in STACKS:
        rendered = render_stack(stack)
        for rs in manifests_of(rendered, "RayService"):
            for pod in ray_service_pods(rs):
                assert f"Pod.{pod['metadata']['namespace']}.{pod['metadata']['name']}" in resources
        for dep in manifests_of(rendered, "Deployment"):
            assert f"Deployment.{dep['metadata']['namespace']}.{dep['metadata']['name']}" in resources
    assert f"Deployment.llm.{GATEWAY_NAME}" in resources
    for rs in manifests_of(render_stack("prod"), "RayService"):
        assert f"Deployment.llm.{router_name(rs['metadata']['name'])}" in resources
    assert report["summary"]["passed"] > 500


def test_only_checks_that_can_not_apply_are_skipped(report: dict[str, Any]) -> None:
    """Probes KubeRay injects, the image's own uid, a writable root for Ray, and the GCS Redis password KubeRay
    hands a head as an environment variable (configureRedisFT); nothing about privileges."""
    skipped = {r["check_id"] for r in _results(report, "skipped_checks")}
    router_only = {"CKV_K8S_38"}
    assert skipped <= {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_22", "CKV_K8S_40", "CKV_K8S_35", *router_only}
    redis_skips = {r["resource"] for r in _results(report, "skipped_checks") if r["check_id"] == "CKV_K8S_35"}
    assert redis_skips and all("head" in r for r in redis_skips), redis_skips
    # The routers' token (their discovery lists pods).
    routers = {r["resource"] for r in _results(report, "skipped_checks") if r["check_id"] in router_only}
    assert routers and all(r.startswith("Deployment.llm.") and r.endswith("-router") for r in routers), routers
