"""End-to-end: a Ray head started as KubeRay starts the rendered one, with token authentication on.

The rendered RayService asks KubeRay for token authentication
(`rayClusterConfig.authOptions`); KubeRay 1.7 then gives the head's Ray
container RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the named Secret
(common/pod.go SetContainerTokenAuthEnvVars). Here the head runs the
rendered `ray start` command on 127.0.0.1 with that environment and a token
of the test's own, and the checks are what a pod on the head's node could
try: the job API (code execution), the Serve REST API KubeRay drives, and a
driver on the GCS, each without the token, with a wrong one and with the
right one. What must stay open without a token stays open: the probes'
routes and the metrics port Prometheus scrapes.

Run with ``E2E=1 pytest -s tests/e2e/test_ray_auth_e2e.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra.serving.ray_service import RAY_AUTH_MODE, ray_auth_secret_name
from localserve.processes import child_env
from localserve.ray_cluster import HOST, RayNode, kuberay_head_params, loopback_params, ray_node
from tests.harness import manifests_of, render_stack

pytestmark = pytest.mark.e2e

STACK = "dev"
NODE_START_TIMEOUT_S = 120.0
DRIVER_TIMEOUT_S = 90.0
# The environment KubeRay puts on every Ray container when authOptions.mode is
# token and no Kubernetes token auth is asked for (pod.go SetContainerTokenAuthEnvVars:
# utils.RAY_AUTH_MODE_ENV_VAR, utils.RAY_AUTH_TOKEN_ENV_VAR from the Secret's key).
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"


def say(line: str) -> None:
    print(f"[ray-auth] {line}", flush=True)


@dataclass(frozen=True)
class Head:
    """The running head: its dashboard, agent, metrics and GCS addresses, and the token it holds."""

    node: RayNode
    token: str
    dashboard: str
    agent: str
    metrics: str
    gcs: str


@pytest.fixture(scope="module")
def rendered_cluster() -> dict[str, Any]:
    """The dev stack's rendered rayClusterConfig, checked to ask for token auth from its own Secret."""
    rendered = render_stack(STACK)
    (service, *_) = manifests_of(rendered, "RayService")
    cluster: dict[str, Any] = service["spec"]["rayClusterConfig"]
    name = service["metadata"]["name"]
    assert cluster["authOptions"] == {"mode": RAY_AUTH_MODE, "secretName": ray_auth_secret_name(name)}
    secrets_by_name = {s["metadata"]["name"]: s for s in manifests_of(rendered, "Secret")}
    secret = secrets_by_name[ray_auth_secret_name(name)]
    # The token is generated at deploy time and never reaches the render.
    assert secret["stringData"] == "[secret]"
    return cluster


def kuberay_auth_env(cluster: dict[str, Any], token: str) -> dict[str, str]:
    """What KubeRay adds to a Ray container for `authOptions` (the Secret's value is the test's token)."""
    options = cluster["authOptions"]
    assert options["mode"] == "token" and not options.get("enableK8sTokenAuth")
    return {AUTH_MODE_ENV: options["mode"], AUTH_TOKEN_ENV: token}


@pytest.fixture(scope="module")
def head(rendered_cluster: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[Head]:
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail("E2E_REQUIRED=1 but Ray is not installed")
        pytest.skip("Ray is not installed")
    work = Path(tempfile.mkdtemp(prefix="rayauth_", dir="/tmp"))
    token = secrets.token_urlsafe(36)
    params = {**kuberay_head_params(rendered_cluster), **loopback_params(head=True)}
    node = ray_node(
        "head",
        params,
        kuberay_auth_env(rendered_cluster, token),
        head=True,
        temp_dir=work / "head",
        log_dir=work / "logs",
    )
    failed_before = request.session.testsfailed
    try:
        node.start_until_up(NODE_START_TIMEOUT_S)
        say(f"head up with token auth: dashboard {HOST}:{params['dashboard-port']}")
        yield Head(
            node=node,
            token=token,
            dashboard=f"http://{HOST}:{params['dashboard-port']}",
            agent=f"http://{HOST}:{params['dashboard-agent-listen-port']}",
            metrics=f"http://{HOST}:{params['metrics-export-port']}",
            gcs=f"{HOST}:{params['port']}",
        )
    finally:
        node.stop()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs kept in {work}")


def call(url: str, token: str | None = None, method: str = "GET", body: object | None = None) -> tuple[int, str]:
    """One HTTP request, with `Authorization: Bearer <token>` when a token is given; (status, body)."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def test_the_job_api_refuses_a_request_without_the_token_and_runs_none(head: Head) -> None:
    job = {"entrypoint": "echo pwned", "submission_id": "no-token"}
    assert call(f"{head.dashboard}/api/jobs/", method="POST", body=job)[0] == 401
    assert call(f"{head.dashboard}/api/jobs/", token="wrong-" + head.token, method="POST", body=job)[0] == 403
    assert call(f"{head.dashboard}/api/jobs/")[0] == 401
    status, body = call(f"{head.dashboard}/api/jobs/", token=head.token)
    assert status == 200, body
    assert [j for j in json.loads(body) if j.get("submission_id") == "no-token"] == []
    say("job API: 401 without a token, 403 with a wrong one, no job made")


def test_the_job_api_answers_with_the_token(head: Head) -> None:
    job = {"entrypoint": "echo authorised", "submission_id": "with-token"}
    status, body = call(f"{head.dashboard}/api/jobs/", token=head.token, method="POST", body=job)
    assert status == 200, body
    assert json.loads(body)["submission_id"] == "with-token"
    say("job API: a job submitted with the token is accepted")


def test_the_serve_api_kuberay_drives_needs_the_token(head: Head) -> None:
    """KubeRay's operator reads the Secret and sends the token (utils.GetRayDashboardClientFunc)."""
    url = f"{head.dashboard}/api/serve/applications/"
    assert call(url)[0] == 401
    assert call(url, method="PUT", body={"applications": []})[0] == 401
    status, body = call(url, token=head.token)
    assert status == 200, body
    say("Serve REST API: 401 without a token, 200 with it")


def test_the_dashboard_agent_refuses_without_the_token(head: Head) -> None:
    """The agent (52365 in a pod) takes job submissions too: its job route, without and with the token."""
    job = {"entrypoint": "echo pwned", "submission_id": "agent-no-token"}
    assert call(f"{head.agent}/api/job_agent/jobs/", method="POST", body=job)[0] == 401
    assert call(f"{head.agent}/api/job_agent/jobs/", token="wrong-" + head.token, method="POST", body=job)[0] == 403
    status, body = call(f"{head.agent}/api/job_agent/jobs/agent-no-token/logs", token=head.token)
    assert status != 401 and status != 403, body
    say("dashboard agent: its job route refuses a request without the token")


def test_probes_and_metrics_stay_open(head: Head) -> None:
    """KubeRay's probes (/api/healthz, /api/gcs_healthz, /api/local_raylet_healthz) and Prometheus carry no token."""
    for url in (
        f"{head.dashboard}/api/gcs_healthz",
        f"{head.agent}/api/healthz",
        f"{head.agent}/api/local_raylet_healthz",
    ):
        status, body = call(url)
        assert status == 200, (url, body)
    status, body = call(f"{head.metrics}/metrics")
    assert status == 200 and "ray_" in body
    say("health routes and the metrics port answer without a token")


DRIVER = "import ray; ray.init(address='{address}', log_to_driver=False); print('connected', ray.cluster_resources())"


def run_driver(gcs: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A driver on the GCS, as the preStop hook's `ray.init(address='auto')` and Serve's replicas connect."""
    full = child_env({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **env})
    for name in (AUTH_TOKEN_ENV, "RAY_AUTH_TOKEN_PATH"):
        if name not in env:
            full.pop(name, None)
    # No token file in this home either: only what the test passes counts.
    with tempfile.TemporaryDirectory(prefix="rayauth_home_", dir="/tmp") as home:
        full["HOME"] = home
        return subprocess.run(
            [sys.executable, "-c", DRIVER.format(address=gcs)],
            env=full,
            capture_output=True,
            text=True,
            timeout=DRIVER_TIMEOUT_S,
            check=False,
        )


def test_the_gcs_refuses_a_driver_without_the_token_and_takes_one_with_it(head: Head) -> None:
    refused = run_driver(head.gcs, {AUTH_MODE_ENV: "token"})
    assert refused.returncode != 0 and "connected" not in refused.stdout, refused.stdout
    wrong = run_driver(head.gcs, {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: "wrong-" + head.token})
    assert wrong.returncode != 0 and "connected" not in wrong.stdout, wrong.stdout
    accepted = run_driver(head.gcs, {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: head.token})
    assert accepted.returncode == 0 and "connected" in accepted.stdout, accepted.stderr[-3000:]
    say("GCS: drivers without the token or with a wrong one are refused; with it, connected")
