"""The request router's front: nginx in the router pod, passing the load balancer only the API's routes.

Why a front at all: vllm-router serves its control API on the same port as
the OpenAI routes, with no setting to turn it off or move it (server.rs of
the pinned release: `admin_routes` and `worker_routes` are merged into the
one app). Its `/add_worker`, `/remove_worker`, `POST /workers` and
`/flush_cache` need no key, so anyone the load balancer admits could take
the replicas out of rotation, or add a server of their own and receive
every prompt with its caller's API key (measured in
tests/test_router_front.py against the pinned router, without the front).
Its own `--api-key-validation-urls` cannot close them: it checks any valid
caller key the same way on every route, so every API user would still
hold the control API.

So the router listens on the pod's loopback only, and nginx listens on the
port the load balancer sends to, passing the API's routes (the ones the
replicas' guard serves) and the router's probes, and answering everything
else 404, in the OpenAI error shape. nginx rather than a front of our own:
it streams each token as it comes without a Python hop per chunk (the
router's whole reason is speed), and its graceful stop (SIGQUIT, which the
image declares as its stop signal) finishes the requests it holds.

The same text runs in the twin and the tests, with loopback ports and a
scratch directory (`FrontAddresses`), on Debian's nginx.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from infra.config.fields import whole_cores
from infra.serving.ports import RAY_PORTS, Port
from workloads.inference_server.catalog import RequestLimits
from workloads.inference_server.guard import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    INVALID_REQUEST,
    SERVER_ERROR,
    body_cap,
    error_body,
    server_message,
    too_large,
)

# What clients reach: the port name and number the replicas' servers use, so
# the load balancer's target port and the clients' URL do not change.
FRONT_PORT = RAY_PORTS.openai
# The router itself, on the pod's loopback: only the front reaches it.
ROUTER_BACKEND = Port("router-api", 8102)
# vllm-router's probes: /liveness answers while the process runs; /readiness
# only once it has a healthy replica to send to.
LIVENESS_PATH = "/liveness"
READINESS_PATH = "/readiness"
MODELS_PATH = "/v1/models"
# The routes the front passes, and the one method each takes: the
# generation routes the replicas' guard limits, the model list clients
# read, and the probes (which say only whether the router is up).
ROUTES: dict[str, str] = {
    COMPLETIONS_PATH: "POST",
    CHAT_PATH: "POST",
    MODELS_PATH: "GET",
    LIVENESS_PATH: "GET",
    READINESS_PATH: "GET",
}
# The front container's share of the router pod: nginx proxying on loopback
# needs little (0.7-1.0 ms of CPU a streamed request, benchmarks/README.md).
FRONT_CPU = "100m"
FRONT_CPU_LIMIT = "500m"
FRONT_MEMORY = "128Mi"


def worker_processes(cpu_limit: str) -> int:
    """nginx's workers for a CPU limit: one per core the front may use at once, a part counted whole."""
    return whole_cores(cpu_limit)


# One worker (half a core of limit): each worker takes thousands of
# connections, and a second could never run beside the first for long. Two
# only split each engine step's chunks between two processes, each woken for
# its own: with one, the front spent 13% less CPU a request behind vLLM's own
# stream, in 7 of 8 rounds at each of c=8 and c=32 (benchmarks/README.md,
# "The front's nginx workers"). The router's runtime threads follow the same
# rule (router.py runtime_threads).
WORKERS = worker_processes(FRONT_CPU_LIMIT)
WORKER_CONNECTIONS = 4096
# Idle keep-alive connections to the router (on loopback, so cheap to hold):
# without them every request would open one.
UPSTREAM_KEEPALIVE = 256
# What the router adds to a body it passes on. It reads each request into
# its own types and writes it out again with their defaults spelled out
# ("echo": false, "skip_special_tokens": true, ...): 124 bytes on a
# completion and 234 on a chat with the pinned router, however many messages,
# parts, tools or stops the request holds (tests/test_router_front.py
# measures them). The front holds the replicas' cap less this, so every body
# it admits is one their guard admits after the router: the caller meets one
# cap. Only a number written again longer grows a body further (a whole
# number becomes a float, "1" -> "1.0"), so a request needs hundreds of such
# fields (a large logit_bias) to outgrow the allowance; the guard then
# answers with the same 413 the front would have.
ROUTER_BODY_GROWTH = 1024
# Scratch space nginx needs writable (its pid and temp files); an emptyDir in the pod.
POD_SCRATCH = "/tmp"
CONFIG_DIR = "/etc/nginx/front"
CONFIG_FILE = "nginx.conf"
# A request body up to this size is held in memory; a larger one in a scratch file.
BODY_BUFFER = "64k"
# Where nginx writes request bodies larger than the buffer (answers stream
# unbuffered), all under the scratch space.
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


@dataclass(frozen=True)
class FrontAddresses:
    """Where the front listens, where the router is, where nginx may write."""

    listen: str
    upstream: str
    scratch: str


POD_ADDRESSES = FrontAddresses(
    listen=str(FRONT_PORT.number),
    upstream=f"127.0.0.1:{ROUTER_BACKEND.number}",
    scratch=POD_SCRATCH,
)


def _quoted(body: bytes) -> str:
    """An error body as an nginx string: single-quoted, so the JSON's double quotes stay as they are."""
    text = body.decode()
    if any(c in text for c in "'\\$\n"):
        raise ValueError(f"error body needs escaping in nginx: {text!r}")
    return f"'{text}'"


def _returned(status: int, body: bytes) -> str:
    """nginx's directive answering ``status`` with ``body``."""
    return f"return {status} {_quoted(body)};"


def _error(status: int, message: str, type_: str, code: str | None) -> str:
    return _returned(status, error_body(message, type_=type_, param=None, code=code))


# The 5xx answers the front writes itself, in place of the router's and nginx's own:
# the router's 500 when no replica answered names the replica's address in its
# body ("Request failed: error sending request for url (http://<pod IP>:8000/...)"),
# and nginx's 502 and 504 (the router gone, or silent past the timeout) are HTML
# pages. The replicas' guard already answers every 5xx with a fixed message
# (guard.openai_error), so the front replaces these with the same ones. 503 is
# not replaced: the router's own (no ready replica, a full queue) names nothing
# behind it and the replicas' carries its Retry-After. Once nginx intercepts,
# a replica's 413 gets the front's own 413 too (the same body as the guard's).
REPLACED_ERRORS = (500, 502, 504)


@dataclass(frozen=True)
class FrontPlan:
    """The front of one router: the body cap it holds for the replicas' guard, and how long a request may take."""

    max_body_bytes: int
    request_timeout_s: int
    # nginx's worker processes (benchmarks/router_hop.py measures others).
    workers: int = WORKERS

    @staticmethod
    def of(limits: RequestLimits, request_timeout_s: int) -> FrontPlan:
        """The front for the stack's request limits: it refuses what every replica's guard would once
        the router has added its defaults (:data:`ROUTER_BODY_GROWTH`)."""
        return FrontPlan(body_cap(limits) - ROUTER_BODY_GROWTH, request_timeout_s)

    def config(self, at: FrontAddresses = POD_ADDRESSES) -> str:
        """nginx.conf: the API's routes to the router, everything else 404."""
        scratch = at.scratch.rstrip("/")
        temp_paths = "\n".join(f"    {kind}_temp_path {scratch}/{kind};" for kind in TEMP_PATHS)
        return f"""# Rendered by infra/serving/router_front.py: edit that, not this.
worker_processes {self.workers};
pid {scratch}/nginx.pid;
error_log stderr warn;

events {{
    worker_connections {WORKER_CONNECTIONS};
}}

http {{
    access_log off;
    server_tokens off;
    default_type application/json;
{temp_paths}

    # The replicas' guard refuses a larger body. The whole body is read here
    # first, so a slow sender holds a connection of nginx's, not one of the
    # router's; a body larger than the buffer waits in a scratch file, so
    # many large prompts at once do not add up in the container's memory.
    client_max_body_size {self.max_body_bytes};
    client_body_buffer_size {BODY_BUFFER};

    upstream router {{
        server {at.upstream};
        keepalive {UPSTREAM_KEEPALIVE};
    }}

{self._server(at.listen)}
}}
"""

    def _server(self, listen: str) -> str:
        locations = "\n".join(self._location(path, method) for path, method in ROUTES.items())
        not_found = _error(404, "Not found: this endpoint serves the OpenAI API", "not_found_error", "not_found")
        # The replicas' guard's own 413, word for word: the caller meets one
        # cap with one answer, whichever of the two holds it.
        refused = too_large(self.max_body_bytes)
        over_cap = _returned(refused.status, refused.body())
        replaced_pages = "\n".join(f"        error_page {status} @status_{status};" for status in REPLACED_ERRORS)
        replaced_locations = "\n".join(
            f"""
        location @status_{status} {{
            {_error(status, server_message(status), SERVER_ERROR, None)}
        }}"""
            for status in REPLACED_ERRORS
        )
        return f"""    server {{
        listen {listen} reuseport;

        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        # Tokens go out as the replica streams them.
        proxy_buffering off;
        # The longest generation the limits allow, as the router's own timeout.
        proxy_read_timeout {self.request_timeout_s}s;
        proxy_send_timeout {self.request_timeout_s}s;
        error_page 413 @too_large;
        # The router's own 500 names a replica's address; nginx's own 502 and
        # 504 are HTML. Each is answered here in the OpenAI shape instead.
        proxy_intercept_errors on;
{replaced_pages}

{locations}

        location @too_large {{
            {over_cap}
        }}
{replaced_locations}

        location / {{
            {not_found}
        }}
    }}"""

    @staticmethod
    def _location(path: str, method: str) -> str:
        wrong_method = _error(405, f"{path} takes {method}", INVALID_REQUEST, "method_not_allowed")
        return f"""        location = {path} {{
            if ($request_method != {method}) {{
                {wrong_method}
            }}
            proxy_pass http://router;
        }}"""


def config_digest(text: str) -> str:
    """A short digest of the config, on the pod template, so a changed config rolls the pods."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
