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
from pathlib import Path

import pytest

from tests.e2e import twin_log

pytestmark = pytest.mark.e2e

DAY2_TIMEOUT_S = 1200.0


def test_day2_of_prod_passes(tiny_model: Path, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail("E2E_REQUIRED=1 but redis-server or openssl is not installed")
        pytest.skip("redis-server and openssl are needed (apt-get install redis-server openssl)")
    done = twin_log.run(["twin.day2", "--stack", "prod"], tmp_path / "day2.log", DAY2_TIMEOUT_S)
    done.assert_passed("day2 prod")
    verdicts = done.verdicts
    upgrade = [v for v in verdicts if "[upgrade]" in v]
    assert any(" 0 failed" in v for v in upgrade), upgrade
    assert any("Redis cleanup Job" in v and "-> 0" in v for v in upgrade), upgrade
