"""The process a "vllm-server" replica runs: vLLM's own OpenAI server, guarded, with its metrics on their own port.

Started by :class:`inference_server.vllm_server.VllmServer` with a JSON spec in
:data:`SPEC_ENV`. The engine arguments are the same keyword arguments Serve
LLM would pass to ``AsyncEngineArgs`` (``engine.engine_kwargs``); they are set
on vLLM's parsed CLI namespace by name, so a value never goes through a
string round trip, and a name vLLM does not know stops the start.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
from typing import Any

# First, before anything imports vLLM, in this process and in each engine
# process multiprocessing's spawn starts from it (which runs this module as
# `__mp_main__` before it unpickles vLLM's process object); not where the
# replica imports it for SPEC_ENV. vLLM titles its processes (VLLM::EngineCore,
# VLLM::Worker) with setproctitle after `import vllm` has rewritten environment
# variables (vllm/env_override.py). setproctitle sets itself up on its first
# call, finding the argv area it overwrites by walking back from the first
# environment string; when that variable was rewritten, the string is on the
# heap, the setup fails silently and the engine stays "python" in ps, top and
# /proc (whether it does depends on the environment's order). This call sets
# it up while the environment is as exec left it. The server itself takes
# vLLM's name for an API server process: in a replica's environment the title
# can use only the command line's own bytes less one, and its command line
# read back as "... -m inference_server.vllm_mai", which no one recognises.
API_SERVER_TITLE = "VLLM::APIServer"
# SIGUSR1 prints every Python thread's stack to stderr (the replica's log),
# from the first line on: a server that takes minutes to start shows where
# it is (`kill -USR1 <pid>`) without a debugger on the node. vLLM does not use
# the signal; the engine processes register it too.
STACKS_SIGNAL = signal.SIGUSR1
if __name__ in ("__main__", "__mp_main__"):
    faulthandler.register(STACKS_SIGNAL, all_threads=True)

    import setproctitle  # vLLM depends on it

    if __name__ == "__main__":
        setproctitle.setproctitle(API_SERVER_TITLE)
    else:
        setproctitle.getproctitle()


SPEC_ENV = "INFERENCE_VLLM_SERVER_SPEC"
# The pid of the replica that started this server: it dies, this server gets SIGTERM.
PARENT_ENV = "INFERENCE_VLLM_SERVER_PARENT"
PR_SET_PDEATHSIG = 1
GUARD_MIDDLEWARE = "inference_server.vllm_guard.VllmServerGuard"


def server_args(spec: dict[str, Any]) -> Any:
    """vLLM's serve arguments for the spec: its own parser, then the engine keyword arguments by name."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI server (vllm-server layout)"))  # type: ignore[no-untyped-call]
    argv = [
        "--model",
        spec["model"],
        "--served-model-name",
        spec["served_model_name"],
        "--host",
        spec["host"],
        "--port",
        str(spec["port"]),
        "--middleware",
        GUARD_MIDDLEWARE,
        # One line per request on the hot path buys nothing the metrics do not show.
        "--disable-uvicorn-access-log",
    ]
    args = parser.parse_args(argv)
    unknown = sorted(k for k in spec["engine_kwargs"] if not hasattr(args, k))
    if unknown:
        raise SystemExit(f"vLLM {__import__('vllm').__version__} has no engine arguments {unknown}")
    for key, value in spec["engine_kwargs"].items():
        setattr(args, key, value)
    validate_parsed_serve_args(args)
    return args


def die_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` dies, however it dies (Linux); exits now if it already has.

    Set here, after exec, and not in the replica's ``preexec_fn``: that ran
    Python (an import, a dlopen) between fork and exec in a process whose
    gRPC threads may hold the locks those take, so the child could hang
    before its server ever started. SIGTERM, not
    SIGKILL: vLLM's server then stops its engine processes, and main() ends
    its process group on the way out.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        # The replica died before the signal was armed: no one would ever stop this server.
        raise SystemExit(f"the replica (pid {parent}) that started this server is gone")


def main() -> int:
    if PARENT_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_ENV]))
    spec = json.loads(os.environ[SPEC_ENV])
    args = server_args(spec)

    import prometheus_client
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    cli_env_setup()  # type: ignore[no-untyped-call]
    # The registry vLLM's own /metrics serves, on a port outside the API-key
    # guard: Prometheus has no API key, and the NetworkPolicy lets only it in.
    prometheus_client.start_http_server(
        spec["metrics_port"], addr=spec["metrics_host"], registry=get_prometheus_registry()
    )
    try:
        uvloop.run(run_server(args))
    finally:
        # This process leads its own group (the replica starts it so): take
        # along any engine process vLLM's shutdown left, this one last.
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
