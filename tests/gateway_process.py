"""The model gateway process as the tests run it (tests/test_gateway.py, tests/test_gateway_wake.py).

``python -m inference_server.gateway``, as the serving image runs it, with settings the tests write,
and the requests and metrics they read from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from localserve.processes import free_port
from workloads.inference_server.gateway import SETTINGS_ENV

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-gateway-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096


class GatewayProcess:
    """``python -m inference_server.gateway`` with the given settings, its stderr collected by a thread."""

    def __init__(self, settings: dict[str, Any] | None, extra_env: dict[str, str] | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != SETTINGS_ENV}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workloads"), env.get("PYTHONPATH", "")])
        if settings is not None:
            env[SETTINGS_ENV] = json.dumps(settings)
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inference_server.gateway"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.listening = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "gateway listening on http://" in line:
                self.listening.set()

    def wait_listening(self) -> None:
        assert self.listening.wait(15), "the gateway did not start:\n" + "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def gateway_settings(tmp: Path, routes: dict[str, str], **overrides: Any) -> dict[str, Any]:
    keys = tmp / "keys"
    keys.write_text(f"tester:{KEY}\n")
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "routes": routes,
        "api_keys_file": str(keys),
        "api_keys_env": "GATEWAY_TEST_KEYS_UNSET",
        "max_body_bytes": MAX_BODY,
        "request_timeout_s": 10,
        "connect_timeout_s": 2,
    }
    return {**settings, **overrides}


def post(url: str, body: bytes | Any, headers: dict[str, str] | None = None) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Content-Type": "application/json", **(headers if headers is not None else AUTH)}
    return httpx.post(url, content=raw, headers=head, timeout=10)


def error_of(response: httpx.Response) -> dict[str, Any]:
    payload = response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    return dict(payload["error"])


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


class Loop:
    """An event loop in a thread, serving the tests' aiohttp stand-ins (routers, proxies, replicas) on loopback."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def serve(self, handler: Any) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
