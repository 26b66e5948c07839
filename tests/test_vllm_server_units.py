"""The vllm-server layout's parts, without a running server: catalogue rules, guard, autoscaling, process spec."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from inference_server.autoscale import ONGOING_METRIC, POLICY_PATH, ongoing_requests_policy
from inference_server.catalog import Catalog
from inference_server.vllm_guard import (
    DRAIN_FILE_ENV,
    DRAIN_REREAD_S,
    NODE_DRAIN_FILE_ENV,
    SETTINGS_ENV,
    VllmServerGuard,
)
from pydantic import ValidationError

from localserve.processes import STAT_STATE, stat_fields
from tests.guard_calls import Downstream, send_to
from tests.harness import start_importing_server, workloads_env


def catalog(**overrides: Any) -> dict[str, Any]:
    model: dict[str, Any] = {
        "model_id": "m",
        "source": "/models/m",
        "max_model_len": 4096,
        "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
    }
    model.update(overrides.pop("model", {}))
    doc: dict[str, Any] = {"models": [model], "layout": "vllm-server"}
    doc.update(overrides)
    return doc


# ---------------------------------------------------------------- catalogue


def test_the_layout_defaults_keep_existing_catalogues_on_serve_ingress() -> None:
    parsed = Catalog.model_validate({"models": [catalog()["models"][0]]})
    assert parsed.layout == "serve-ingress"
    assert (parsed.vllm_server.port, parsed.vllm_server.metrics_port) == (8100, 8101)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"models": [catalog()["models"][0], {**catalog()["models"][0], "model_id": "n"}]}, "exactly one model"),
        ({"model": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size must be 1"),
        ({"vllm_server": {"port": 9000, "metrics_port": 9000}}, "must differ"),
    ],
)
def test_what_the_layout_can_not_serve_is_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Catalog.model_validate(catalog(**overrides))


def test_a_model_at_zero_is_served_by_either_layout() -> None:
    """The server wakes a vllm-server model at zero through Serve's proxy (VllmServer.__call__); the stack's
    rules require the gateway that sends that request (serving.vllm_server_problem)."""
    for layout in ("vllm-server", "serve-ingress"):
        doc = catalog(model={"autoscaling": {"min_replicas": 0, "max_replicas": 2}})
        doc["layout"] = layout
        assert Catalog.model_validate(doc).models[0].autoscaling.min_replicas == 0


# ---------------------------------------------------------------- guard in vLLM's server


def guard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[VllmServerGuard, Downstream, Path]:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    settings = {"api_keys_file": str(keys), "api_keys_env": "UNUSED", "limits": {"max_tokens": 64}, "model_ids": ["m"]}
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(settings))
    drain = tmp_path / "draining"
    monkeypatch.setenv(DRAIN_FILE_ENV, str(drain))
    downstream = Downstream()
    return VllmServerGuard(downstream), downstream, drain


def test_the_server_guard_refuses_to_start_without_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SETTINGS_ENV):
        VllmServerGuard(Downstream())


@pytest.mark.parametrize(
    "path", ["/v1/responses", "/v1/messages", "/inference/v1/generate", "/scale_elastic_ep", "/tokenize", "/metrics"]
)
def test_vllm_routes_the_platform_does_not_offer_are_404_with_a_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: str
) -> None:
    app, downstream, _ = guard(monkeypatch, tmp_path)
    status, doc = send_to(app, path, body={"model": "m", "input": "x"})
    assert status == 404 and doc["error"]["type"] == "invalid_request_error"
    assert downstream.paths == []


def test_served_routes_keep_keys_and_limits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    app, downstream, _ = guard(monkeypatch, tmp_path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert send_to(app, "/v1/chat/completions", body=chat)[0] == 200
    assert send_to(app, "/v1/chat/completions", body=chat, key=None)[0] == 401
    assert send_to(app, "/v1/chat/completions", body={**chat, "max_tokens": 65})[0] == 400
    assert send_to(app, "/v1/chat/completions", body={**chat, "max_tokens": "8"})[0] == 400
    assert send_to(app, "/v1/models", method="GET")[0] == 200
    assert downstream.paths == ["/v1/chat/completions", "/v1/models"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions/render",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        ),
        ("/v1/completions/render", {"model": "m", "prompt": "hi", "max_tokens": 8}),
    ],
)
def test_the_render_routes_the_router_asks_keep_the_generation_routes_keys_and_limits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: str, body: dict[str, Any]
) -> None:
    # The request router's cache_aware policy renders each prompt to token ids on the
    # replicas; the body is the generation request's, and is held to the same rules.
    app, downstream, _ = guard(monkeypatch, tmp_path)
    assert send_to(app, path, body=body)[0] == 200
    assert send_to(app, path, body=body, key=None)[0] == 401
    assert send_to(app, path, body={**body, "model": "other"})[0] == 404
    assert send_to(app, path, body={**body, "max_tokens": 65})[0] == 400
    assert send_to(app, path, body={**body, "max_tokens": 8.0})[0] == 400
    status, doc = send_to(app, path, body={**body, "kv_transfer_params": {"do_remote_prefill": True}})
    assert status == 400 and doc["error"]["param"] == "kv_transfer_params"
    assert downstream.paths == [path]


def test_a_draining_replica_fails_its_readiness_but_serves_what_arrives(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    app, downstream, drain = guard(monkeypatch, tmp_path)
    assert send_to(app, "/health", method="GET", key=None)[0] == 200
    drain.touch()
    assert send_to(app, "/health", method="GET", key=None)[0] == 503
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert send_to(app, "/v1/chat/completions", body=chat)[0] == 200
    assert downstream.paths == ["/health", "/v1/chat/completions"]


def _headers_of(app: Any, path: str, **kwargs: Any) -> dict[bytes, bytes]:
    sent: list[dict[str, Any]] = []
    raw = json.dumps(kwargs.get("body")).encode() if kwargs.get("body") is not None else b""
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer k1")]
    scope = {"type": "http", "method": kwargs.get("method", "POST"), "path": path, "headers": headers, "root_path": ""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return dict(sent[0]["headers"])


def test_a_draining_replica_closes_each_connection_after_its_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A keep-alive client would stay on the draining server: each answer tells it to reconnect (through the LB)."""
    now = [1000.0]
    monkeypatch.setattr(VllmServerGuard, "clock", staticmethod(lambda: now[0]))
    app, _, drain = guard(monkeypatch, tmp_path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert b"connection" not in _headers_of(app, "/v1/chat/completions", body=chat)
    drain.touch()
    # A request goes by the files' last reading (the first request's, at 1000.0) until it is DRAIN_REREAD_S old...
    now[0] = 1000.0 + DRAIN_REREAD_S * 0.98
    assert b"connection" not in _headers_of(app, "/v1/chat/completions", body=chat)
    now[0] = 1000.0 + DRAIN_REREAD_S
    assert _headers_of(app, "/v1/chat/completions", body=chat)[b"connection"] == b"close"


def test_the_readiness_probe_reads_the_drain_files_afresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """...while /health reads them each time: the probe fails at once, and the next answer closes its connection."""
    monkeypatch.setattr(VllmServerGuard, "clock", staticmethod(lambda: 1000.0))
    app, _, drain = guard(monkeypatch, tmp_path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert b"connection" not in _headers_of(app, "/v1/chat/completions", body=chat)
    drain.touch()
    assert _headers_of(app, "/health", method="GET")[b"connection"] == b"close"
    assert _headers_of(app, "/v1/chat/completions", body=chat)[b"connection"] == b"close"


def test_the_pods_drain_file_drains_every_server_of_the_pod(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The preStop hook's file, set before Ray is told anything (its GCS may already be gone)."""
    node_file = tmp_path / "node-draining"
    monkeypatch.setenv(NODE_DRAIN_FILE_ENV, str(node_file))
    app, _, own = guard(monkeypatch, tmp_path)
    assert send_to(app, "/health", method="GET", key=None)[0] == 200
    node_file.touch()
    assert not own.exists()
    assert send_to(app, "/health", method="GET", key=None)[0] == 503


# ---------------------------------------------------------------- autoscaling


def context(replicas: int, reported: dict[str, float] | None, target: float = 8) -> Any:
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    metrics = None if reported is None else {ONGOING_METRIC: reported}
    return SimpleNamespace(
        current_num_replicas=replicas, target_num_replicas=replicas, aggregated_metrics=metrics, config=config
    )


@pytest.mark.parametrize(
    ("replicas", "reported", "desired"),
    [
        (2, {"a": 24.0, "b": 8.0}, 4.0),  # 32 in vLLM's queues at 8 a replica
        (2, {"a": 0.0, "b": 0.0}, 0.0),  # idle: Serve's bounds keep min_replicas
        (3, {"a": 16.0}, 6.0),  # one reported: the others count as its mean
        (2, None, 2),  # nothing reported yet: hold
        (2, {}, 2),
        (0, None, 0),
    ],
)
def test_the_policy_sizes_replicas_by_vllms_queue(
    replicas: int, reported: dict[str, float] | None, desired: float
) -> None:
    assert ongoing_requests_policy(context(replicas, reported))[0] == desired


def _serve_context(config: Any, reported: dict[str, float]) -> Any:
    return SimpleNamespace(
        current_num_replicas=2,
        target_num_replicas=2,
        aggregated_metrics={ONGOING_METRIC: reported},
        config=config,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        total_num_requests=0,  # Serve's own count: no request passes through Serve
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
    )


@pytest.mark.parametrize(("upscale_delay_s", "desired"), [(0, 6), (30, 2)])
def test_serve_takes_the_policy_by_its_path_with_its_own_delays(upscale_delay_s: float, desired: int) -> None:
    pytest.importorskip("ray.serve")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=8,
        target_ongoing_requests=8,
        upscale_delay_s=upscale_delay_s,
        policy={"policy_function": POLICY_PATH},
    )
    # What Serve's controller runs: the policy resolved from its import path, wrapped with the config.
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    # 48 requests in vLLM's queues at 8 a replica: 6 replicas, once the upscale delay has passed.
    assert policy(_serve_context(config, {"a": 24.0, "b": 24.0}))[0] == desired


def test_queue_length_sums_running_and_waiting_over_label_sets() -> None:
    pytest.importorskip("prometheus_client")
    from inference_server.vllm_server import queue_length

    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        ]
    )
    assert queue_length(text + "\n") == 9.0


def test_the_replica_asks_its_servers_metrics_port_for_the_two_queue_gauges_only() -> None:
    """The exposition server vLLM's main starts (prometheus_client's) writes only what the query names."""
    from inference_server.vllm_server import _get, queue_length, queue_url
    from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

    registry = CollectorRegistry()
    labels = ("engine", "model_name")
    Gauge("vllm:num_requests_running", "running", labels, registry=registry).labels("0", "m").set(3)
    Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry).labels("0", "m").set(5)
    Histogram("vllm:e2e_request_latency_seconds", "latency", labels, registry=registry).labels("0", "m").observe(1)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        status, everything = _get(base, 5)
        status_q, asked = _get(queue_url(base), 5)
    finally:
        server.shutdown()
        thread.join(5)
    assert status == status_q == 200
    assert "vllm:e2e_request_latency_seconds_bucket" in everything
    assert "vllm:e2e_request_latency" not in asked and queue_length(asked) == queue_length(everything) == 8.0


# ---------------------------------------------------------------- the replica


@pytest.mark.parametrize(
    ("model", "options"),
    [
        (
            {"accelerator_type": "L40S", "tensor_parallel_size": 4},
            {"num_cpus": 1, "num_gpus": 4, "accelerator_type": "L40S"},
        ),
        ({}, {"num_cpus": 1, "num_gpus": 0}),
    ],
)
def test_a_replica_holds_its_gpus_on_its_accelerator(model: dict[str, Any], options: dict[str, Any]) -> None:
    pytest.importorskip("ray.serve")
    from inference_server.vllm_server import replica_actor_options

    entry = Catalog.model_validate(catalog(model=model)).models[0]
    assert replica_actor_options(entry) == options


def test_the_server_process_gets_the_engine_arguments_by_name() -> None:
    pytest.importorskip("vllm")
    from inference_server.engine import engine_kwargs
    from inference_server.vllm_main import GUARD_MIDDLEWARE, server_args

    parsed = Catalog.model_validate(catalog(model={"engine_overrides": {"enforce_eager": True, "max_num_seqs": 7}}))
    kwargs = engine_kwargs(parsed.models[0], parsed)
    spec = {"model": "/models/m", "served_model_name": "m", "host": "127.0.0.1", "port": 8100, "engine_kwargs": kwargs}
    args = server_args(spec)
    assert (args.max_num_seqs, args.enforce_eager, args.max_model_len) == (7, True, 4096)
    assert args.override_generation_config == {"max_new_tokens": parsed.limits.max_tokens}
    assert args.middleware == [GUARD_MIDDLEWARE]
    assert args.disable_uvicorn_access_log
    with pytest.raises(SystemExit, match="no_such_argument"):
        server_args({**spec, "engine_kwargs": {**kwargs, "no_such_argument": 1}})


# What an engine process does first, as multiprocessing's spawn runs it for a
# server started with `python -m inference_server.vllm_main`: import the main
# module by name (spawn.prepare), then vLLM (unpickling its process object),
# then title itself as vLLM's EngineCore does.
_ENGINE_START = """
import multiprocessing.spawn, sys
if sys.argv[1] == "main-first":
    multiprocessing.spawn.prepare({"init_main_from_name": "inference_server.vllm_main"})
import vllm
from vllm.utils.system_utils import set_process_title
set_process_title("EngineCore")
print(open("/proc/self/comm").read().strip())
"""


def test_the_engine_process_is_titled_whatever_the_environments_order() -> None:
    pytest.importorskip("vllm")
    import os
    import subprocess
    import sys

    # `import vllm` rewrites this variable (vllm/env_override.py); first in
    # the environment, it broke setproctitle's setup in the engine process.
    rewritten = "TORCHINDUCTOR_COMPILE_THREADS"
    env = {rewritten: "1", **{k: v for k, v in os.environ.items() if k != rewritten}}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "workloads"), env.get("PYTHONPATH", "")])
    runs = {
        how: subprocess.Popen(
            [sys.executable, "-c", _ENGINE_START, how],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how in ("main-first", "vllm-only")
    }
    titles = {}
    for how, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        titles[how] = out.strip().splitlines()[-1]
    # Without the server's main module first, the condition is real: the title is lost.
    assert titles["main-first"] == "VLLM::EngineCor", titles
    assert titles["vllm-only"] != "VLLM::EngineCor", titles


def test_a_stopping_replica_serves_through_its_notice_then_stops_its_server(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    import http.server
    import subprocess
    import threading
    import time

    from inference_server.vllm_server import VllmServer

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    metrics = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    doc = catalog(vllm_server={"drain_notice_s": 1.5}, shutdown={"timeout_s": 30, "wait_loop_s": 0.2})
    replica = object.__new__(VllmServer)
    replica._catalog = Catalog.model_validate(doc)
    replica._process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    replica._local_metrics = f"http://127.0.0.1:{metrics.server_address[1]}/metrics"
    replica._drain_file = tmp_path / "draining"
    replica._address_file = None
    replica._stopped = False
    started = time.monotonic()
    try:
        replica.__del__()
    finally:
        metrics.shutdown()
    took = time.monotonic() - started
    # Idle from the start, yet it kept serving for the notice: the probe and the LB need that long.
    assert replica._drain_file.exists() and 1.5 <= took < 10, took
    assert replica._process.poll() is not None


_ARMED = """
import os, sys, time
from inference_server.vllm_main import die_with_parent
die_with_parent(int(sys.argv[1]))
print("armed", flush=True)
time.sleep(60)
"""


def _starter(parent_arg: str) -> str:
    # A stand-in replica: starts the server's first step as a child, prints its pid, then dies.
    return (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {_ARMED!r}, {parent_arg}], stdout=subprocess.PIPE)\n"
        "assert child.stdout.readline() == b'armed\\n'\n"
        "print(child.pid, flush=True)\n"
    )


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie nobody reaped yet) within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while (fields := stat_fields(pid)) is not None and fields[STAT_STATE] != "Z":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_server_ends_with_the_replica_that_started_it() -> None:
    import subprocess
    import sys

    starter = subprocess.run(
        [sys.executable, "-c", _starter("str(__import__('os').getpid())")],
        capture_output=True,
        timeout=60,
        check=True,
        env=workloads_env(),
    )
    assert _gone_within(int(starter.stdout.split()[-1]), 10), "the server outlived the replica that started it"


def test_a_server_whose_replica_is_already_gone_exits_at_once() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ARMED, "1"], capture_output=True, timeout=60, check=False, env=workloads_env()
    )
    assert done.returncode != 0 and b"armed" not in done.stdout
    assert b"the replica (pid 1) that started this server is gone" in done.stderr


def test_nothing_runs_python_between_fork_and_exec_in_the_replicas() -> None:
    # preexec_fn runs Python (imports, dlopen) in the child of a process with gRPC threads, whose
    # locks it may find held, and the server would then never start.
    workloads = Path(__file__).resolve().parents[1] / "workloads"
    users = [str(p.relative_to(workloads)) for p in workloads.rglob("*.py") if "preexec_fn=" in p.read_text()]
    assert users == []


def test_sigusr1_prints_the_servers_stacks_while_it_starts_and_leaves_it_running(tmp_path: Path) -> None:
    """A server that takes minutes to start is asked where it is: every thread's stack, on stderr."""
    pytest.importorskip("vllm")
    import os
    import signal
    import time

    from inference_server.vllm_main import STACKS_SIGNAL

    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = start_importing_server(tmp_path, sink)
    try:
        os.kill(proc.pid, STACKS_SIGNAL)
        deadline = time.monotonic() + 10
        while "File " not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        dump = err.read_text()
        assert "most recent call first" in dump and 'File "' in dump, dump[-2000:]
        # Still starting (importing vLLM, here): the signal asked, it did not stop it.
        assert proc.poll() is None, dump[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
