"""End-to-end: day 2 of the prod stack in the twin (`python -m twin.day2 --stack prod`).

The load-balancer change, the upgrade at peak, KubeRay's switch on the
mirror, and the upgrade under load: render A serving through a local NLB,
render B (a new image and a changed engine argument) deployed by KubeRay's
NewCluster sequence beside it on the same TLS Redis, the old cluster
deleted with its preStop drain, KubeRay's Redis cleanup Job run. Every line
must PASS: no request failed, the old cluster's keys are gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.render import ROOT
from tests.e2e import twin_log

pytestmark = pytest.mark.e2e

DAY2_TIMEOUT_S = 1200.0


def test_day2_of_prod_passes(tiny_model: Path, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail("E2E_REQUIRED=1 but redis-server or openssl is not installed")
        pytest.skip("redis-server and openssl are needed (apt-get install redis-server openssl)")
    log = tmp_path / "day2.log"
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "twin.day2", "--stack", "prod"],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=DAY2_TIMEOUT_S,
            check=False,
        )
    took = time.monotonic() - started
    output = log.read_text(errors="replace")
    verdicts = twin_log.verdicts(output)
    print(f"\n[day2 prod] {took:.0f}s\n" + "\n".join(verdicts), flush=True)
    assert done.returncode == 0, twin_log.failure_message(output)
    assert not twin_log.failures(output)
    upgrade = [v for v in verdicts if "[upgrade]" in v]
    assert any(" 0 failed" in v for v in upgrade), upgrade
    assert any("Redis cleanup Job" in v and "-> 0" in v for v in upgrade), upgrade
