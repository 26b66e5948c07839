"""``python -m twin.local --stack dev``: a stack's RayService on this machine, left running for a person.

The same local cluster as the twin (``python -m twin``): the stack is
rendered, Ray's own checks run, and a cluster shaped like the RayService
starts, with Ray's autoscaler adding and removing the worker nodes. It
serves the OpenAI API at ``http://127.0.0.1:8000/v1`` with an API key
generated for this run (the render's keys are placeholders), prints both,
and stops everything on Ctrl-C. The rendered scale-down delays are kept, so
a model at ``min_replicas: 0`` goes to zero after its idle time, and the next
request wakes it (a new worker node and engine start: about a minute). A
service in the vllm-server layout is served by each replica's own vLLM
server, on a free port each: the run prints their base URLs instead.

``--model-dir`` serves a local model directory (Hugging Face layout: config,
safetensors weights, tokenizer) instead of the tiny random-weight model.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from twin.cluster import REPO, prepare_driver_env
from twin.render import TwinInputError, load_ray_services
from twin.report import Report

DEFAULT_PORT = 8000
SERVICE = "local"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m twin.local", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stack", required=True, help="stack name; reads Pulumi.<stack>.yaml")
    parser.add_argument("--service", help="the RayService to run (default: the stack's first)")
    parser.add_argument("--model-dir", type=Path, help="serve this local model directory instead of the tiny model")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's, at most 2048)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port on 127.0.0.1 (default 8000)")
    return parser.parse_args(argv)


def _model_dir(args: argparse.Namespace) -> Path:
    from twin.model import is_model_dir, tiny_model_dir

    if args.model_dir is None:
        return tiny_model_dir()
    path: Path = args.model_dir.expanduser().resolve()
    if not is_model_dir(path):
        raise TwinInputError(f"--model-dir {path} is not a model directory (config.json, *.safetensors, tokenizer)")
    return path


def _render(stack: str) -> Path:
    from infra.config import ConfigError
    from infra.render import ROOT, known_stacks, render, stack_file, write

    path = stack_file(stack)
    if not path.is_file():
        raise TwinInputError(f"unknown stack '{stack}': known stacks are {', '.join(known_stacks())}")
    try:
        rendered = render(stack, path)
    except ConfigError as err:
        raise TwinInputError(f"the render of {stack} failed:\n{err}") from None
    out = ROOT / "build" / "twin" / f"{stack}-local"
    write(rendered, out)
    return out


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def main(argv: list[str] | None = None) -> int:
    """Starts the local run and serves until Ctrl-C. Exit 2 for bad input, 1 when it could not start."""
    prepare_driver_env()
    args = parse_args(argv)
    for path in (str(REPO), str(REPO / "workloads")):
        if path not in sys.path:
            sys.path.insert(0, path)
    from twin.local_run import LocalRun, port_is_free

    report = Report()
    try:
        if not port_is_free(args.port):
            raise TwinInputError(f"127.0.0.1:{args.port} is taken: stop what listens there or pass --port")
        report.step(SERVICE, f"render: {args.stack}")
        services = load_ray_services(_render(args.stack))
        chosen = [s for s in services if args.service in (None, s.name)]
        if not chosen:
            raise TwinInputError(f"no RayService {args.service} in {args.stack}: {', '.join(s.name for s in services)}")
        model_dir = _model_dir(args)
    except TwinInputError as err:
        print(f"local: {err}", file=sys.stderr)
        return 2
    run = LocalRun(chosen[0], report, stack=args.stack, model_dir=model_dir, port=args.port)
    try:
        if not run.start(max_model_len=args.max_model_len, tiny=args.model_dir is None):
            return 1
        run.announce()
        _wait_for_signal()
    finally:
        report.step(SERVICE, "stopping")
        run.stop()
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"local: interrupted after {time.monotonic() - started:.0f}s; stopped", file=sys.stderr)
        sys.exit(130)
