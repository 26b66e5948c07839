"""The model gateway in the twin: the gateway the render runs, in front of a model's router, and its checks.

The gateway's settings are the ones the render gives its Deployment
(infra/serving/gateway.gateway_plan, from the stack file), with three
substitutions, printed: loopback addresses and free ports; the routes,
whose in-cluster Service names become the addresses of the twin's routers;
and the keys file, the twin's own. The twin runs one RayService at a time,
so a session's gateway has its own model's router live, and every other
model's route points at a port nothing listens on: a model whose router can
not be reached, which the gateway must answer with a 503 and `Retry-After`,
not with another model's server.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.serving.router_front import FrontPlan
from localserve.processes import Child, child_env, free_port
from twin.routing import HOST, start_router
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

READY_MARK = "gateway listening on"
READY_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0


def local_settings(
    rendered: GatewaySettings, routes: Mapping[str, str], keys_file: str, wakes: Mapping[str, str] | None = None
) -> GatewaySettings:
    """The rendered settings on loopback, with the twin's routes, keys and wake URLs; the limits unchanged."""
    if set(routes) != set(rendered.routes):
        raise ValueError(f"routes for {sorted(routes)}, but the render routes {sorted(rendered.routes)}")
    wakes = wakes or {}
    if set(wakes) != set(rendered.wake):
        raise ValueError(f"wake URLs for {sorted(wakes)}, but the render wakes {sorted(rendered.wake)}")
    return rendered.model_copy(
        update={
            "host": HOST,
            "port": free_port(),
            "metrics_port": free_port(),
            "routes": dict(routes),
            "api_keys_file": keys_file,
            "wake": {m: w.model_copy(update={"url": wakes[m]}) for m, w in rendered.wake.items()},
        }
    )


def substitutions(rendered: GatewaySettings, local: GatewaySettings) -> list[str]:
    """What the twin changed, one line each."""
    lines = [f"gateway: listens on {local.host}:{local.port} (render: {rendered.host}:{rendered.port})"]
    lines += [f"gateway: route {m}: {rendered.routes[m]} -> {local.routes[m]}" for m in sorted(rendered.routes)]
    lines += [f"gateway: wake {m}: {rendered.wake[m].url} -> {local.wake[m].url}" for m in sorted(rendered.wake)]
    lines.append(f"gateway: api_keys_file {rendered.api_keys_file} -> the twin's keys file")
    return lines


def start_gateway(settings: GatewaySettings, log: Path) -> Child:
    """The gateway process (`python -m inference_server.gateway`, as the Deployment runs it), once it listens."""
    env = child_env({SETTINGS_ENV: settings.model_dump_json()})
    child = Child.start("gateway", [sys.executable, "-m", "inference_server.gateway"], env, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {child.proc.returncode}: {child.log_tail(5)}")
        if READY_MARK in log.read_text(errors="replace"):
            return child
        time.sleep(0.2)
    child.stop(grace_s=5)
    raise RuntimeError(f"the gateway did not listen within {READY_TIMEOUT_S:.0f}s: {child.log_tail(5)}")


@dataclass(frozen=True)
class Answer:
    """One answer through the gateway: status, the headers a client reads, the body."""

    status: int
    retry_after: str | None
    body: bytes

    def code(self) -> str | None:
        """The OpenAI error's `code`, if the body is one."""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            error = json.loads(self.body)["error"]
            return str(error.get("code")) if error.get("code") is not None else None
        return None


def ask(
    base_url: str,
    path: str,
    key: str | None,
    body: dict[str, Any] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> Answer:
    """One request (POST with `body`, else GET), whatever its status."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{base_url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return Answer(int(answer.status), answer.headers.get("Retry-After"), answer.read())
    except urllib.error.HTTPError as err:
        return Answer(int(err.code), err.headers.get("Retry-After"), err.read())


@dataclass(frozen=True)
class GatewayRun:
    """What one model's session showed through the gateway."""

    # The streamed chat answer for the session's model: its status and the chunks carrying content.
    streamed: Answer
    chunks: int
    # The ids /v1/models listed with the key.
    listed: list[str]
    # Without a key, for the session's model.
    refused: Answer
    # With a key, for a model nobody serves.
    unknown: Answer
    # With a key, for each model whose router is not live in this session.
    absent: dict[str, Answer]


def chat_body(model_id: str, stream: bool) -> dict[str, Any]:
    """A short chat request."""
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "Say hello through the gateway."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }


def measure_gateway(
    rendered: GatewaySettings,
    keys_file: str,
    router_command: Sequence[str],
    router_env: Mapping[str, str],
    front: FrontPlan,
    roots: Sequence[str],
    api_key: str,
    model_id: str,
    log_dir: Path,
    report_sub: Any,
) -> GatewayRun:
    """The session's router in front of ``roots`` and the gateway in front of it, with the other routes dead."""
    router, _ = start_router(router_command, roots, log_dir / "gateway-router.log", front, env=router_env)
    try:
        dead = f"http://{HOST}:{free_port()}"
        routes = {m: (router.base_url.removesuffix("/v1") if m == model_id else dead) for m in rendered.routes}
        local = local_settings(rendered, routes, keys_file)
        for line in substitutions(rendered, local):
            report_sub(line)
        gateway = start_gateway(local, log_dir / "gateway.log")
        try:
            base = f"http://{local.host}:{local.port}"
            streamed = ask(base, "/v1/chat/completions", api_key, chat_body(model_id, stream=True))
            chunks = sum(
                1
                for line in streamed.body.decode(errors="replace").splitlines()
                if line.startswith("data: {") and '"content"' in line
            )
            models = ask(base, "/v1/models", api_key)
            listed = [m["id"] for m in json.loads(models.body).get("data", [])] if models.status == 200 else []
            return GatewayRun(
                streamed=streamed,
                chunks=chunks,
                listed=listed,
                refused=ask(base, "/v1/chat/completions", None, chat_body(model_id, stream=False)),
                unknown=ask(base, "/v1/chat/completions", api_key, chat_body("no-such-model", stream=False)),
                absent={
                    m: ask(base, "/v1/chat/completions", api_key, chat_body(m, stream=False))
                    for m in rendered.routes
                    if m != model_id
                },
            )
        finally:
            gateway.stop(grace_s=10)
    finally:
        router.stop()
