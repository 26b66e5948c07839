"""Which processes a server is made of, found by walking its process tree and waited for, never looked up once.

A server's processes appear in steps: vLLM's API server starts the engine
core, which starts the forward-pass worker; under Ray, the raylet starts the
Serve replica, which starts vLLM's server in a session of its own. A one-shot
lookup right after "ready" can run before the last of them has its title (a
fresh machine, a slow start), so :func:`wait_for_tree` polls the tree from
known roots until every role the cell needs is there, twice in a row with
the same process ids, and fails after a timeout naming what it did find.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from localserve.processes import with_descendants
from workloads.inference_server.vllm_main import API_SERVER_TITLE

FORWARD_PASS = "vLLM worker (forward pass)"
ENGINE_CORE = "vLLM engine core"
API_SERVER = "vLLM API server"
# The routed layout's hop: vllm-router and its nginx front.
ROUTER = "router"
ROUTER_FRONT = "router front"
HOP_ROLES = (ROUTER, ROUTER_FRONT)
# Which part of a server a process is, from the title Ray and vLLM give it
# (first match wins).
ROLES = (
    ("VLLM::EngineCore", ENGINE_CORE),
    ("VLLM::Worker", FORWARD_PASS),
    ("EngineCore", ENGINE_CORE),
    # The project's server titles itself as vLLM names its API servers.
    (API_SERVER_TITLE, API_SERVER),
    ("inference_server.vllm_main", API_SERVER),
    ("vllm.entrypoints.openai.api_server", API_SERVER),
    ("guarded_serve.py", "launcher"),
    # vllm-router titles itself once it runs; before that, its module's name.
    ("vllm::router", ROUTER),
    ("vllm_router", ROUTER),
    # The router's front (nginx: "nginx: master process ...", "nginx: worker process").
    ("nginx: ", ROUTER_FRONT),
    # The model gateway (python -m inference_server.gateway).
    ("inference_server.gateway", "gateway"),
    ("ProxyActor", "Serve proxy"),
    ("haproxy", "Serve proxy"),
    ("VllmServer", "Serve VllmServer replica"),
    ("Ingress", "Serve ingress replica"),
    ("LLMServer", "Serve LLMServer replica"),
    ("ServeController", "Serve controller"),
    ("raylet", "Ray raylet"),
    ("gcs_server", "Ray GCS"),
    ("ray::IDLE", "Ray idle workers"),
    ("DashboardAgent", "Ray agents and monitors"),
    ("RuntimeEnvAgent", "Ray agents and monitors"),
    ("dashboard.py", "Ray agents and monitors"),
    ("monitor.py", "Ray agents and monitors"),
    ("serve_main.py", "Ray driver"),
    ("stock_serve.py", "Ray driver"),
)
# What a measured server must have before a cell can lay out its CPUs (and
# name its CPU: a server whose API server is not found here shows its CPU as "other").
SERVER_ROLES = (API_SERVER, ENGINE_CORE, FORWARD_PASS)


class ServerTreeError(RuntimeError):
    """The server's tree did not show every role in time; the message lists what it had."""


def cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def process_role(pid: int) -> str:
    line = cmdline(pid)
    if line is None:
        return "gone"
    for needle, role in ROLES:
        if needle in line:
            return role
    return "other"


def roles_of(pids: Iterable[int]) -> dict[int, str]:
    return {pid: process_role(pid) for pid in pids}


def describe(pids: Iterable[int]) -> str:
    """One line per process: id, role and the start of its command line (for error messages)."""
    return "\n".join(f"  {pid} {process_role(pid)}: {(cmdline(pid) or '')[:100]}" for pid in sorted(pids)) or "  none"


def wait_for_tree(
    roots: Callable[[], set[int]],
    roles: Iterable[str] = SERVER_ROLES,
    timeout_s: float = 120.0,
    poll_s: float = 0.5,
    what: str = "server",
) -> set[int]:
    """The roots' process tree once it holds every role in ``roles``, the same in two reads in a row.

    ``roots`` is called on every poll: a root that is known only later (a
    replica publishes its server's process id once it is healthy) is picked
    up when it appears.
    """
    wanted = set(roles)
    deadline = time.monotonic() + timeout_s
    previous: set[int] | None = None
    found: set[int] = set()
    while True:
        found = {pid for pid in with_descendants(roots()) if process_role(pid) != "gone"}
        have = set(roles_of(found).values())
        if wanted <= have and found == previous:
            return found
        previous = found if wanted <= have else None
        if time.monotonic() > deadline:
            missing = ", ".join(sorted(wanted - have)) or "a stable process set"
            raise ServerTreeError(
                f"{what}: no {missing} in its process tree after {timeout_s:.0f}s; found:\n{describe(found)}"
            )
        time.sleep(poll_s)
