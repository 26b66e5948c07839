"""``python -m twin.local --stack dev``: a stack's RayServices on this machine, left running for a person.

The same local clusters as the twin (``python -m twin``): the stack is
rendered, Ray's own checks run, and for each RayService a cluster shaped
like it starts, with Ray's autoscaler adding and removing the worker nodes.
The stack answers the OpenAI API at one base URL,
``http://127.0.0.1:8000/v1`` unless ``--port`` says otherwise, with an API
key generated for this run (the render's keys are placeholders); the run
prints both, with only the notes that hold for the stack's models, and stops
everything on Ctrl-C. One RayService in the serve-ingress layout is reached
at its Serve proxy; several RayServices, or replicas that each run their
own vLLM server (the vllm-server layout), are reached through one front
door (:mod:`twin.front_door`) that sends each request to the model it
names. The rendered replica bounds and scale-down delays are kept, so a
model at ``min_replicas: 0`` goes to zero after its idle time and the next
request wakes it (a new worker node and engine start: about a minute).

``--service`` runs one RayService of the stack; ``--model-dir`` serves a
local model directory (Hugging Face layout: config, safetensors weights,
tokenizer) instead of the tiny random-weight model.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
import time
from pathlib import Path

from localserve.affinity_hang import AffinityHangBreaker
from twin.cluster import REPO, prepare_driver_env
from twin.render import TwinInputError, load_ray_services
from twin.report import Report

DEFAULT_PORT = 8000
SERVICE = "local"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m twin.local", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stack", required=True, help="stack name; reads Pulumi.<stack>.yaml")
    parser.add_argument("--service", help="run only this RayService (default: every RayService of the stack)")
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
    """Starts the local run and serves until Ctrl-C. Exit 2 for bad input or a taken port, 1 when it could not start."""
    prepare_driver_env()
    args = parse_args(argv)
    for path in (str(REPO), str(REPO / "workloads")):
        if path not in sys.path:
            sys.path.insert(0, path)
    from twin.local_run import LocalRun, bind_error

    report = Report()
    try:
        taken = bind_error(args.port)
        if taken is not None:
            raise TwinInputError(_port_message(args.port, args.stack, taken))
        report.step(SERVICE, f"render: {args.stack}")
        services = load_ray_services(_render(args.stack))
        chosen = [s for s in services if args.service in (None, s.name)]
        if not chosen:
            raise TwinInputError(f"no RayService {args.service} in {args.stack}: {', '.join(s.name for s in services)}")
        model_dir = _model_dir(args)
        left_out = [s.name for s in services if s.name not in {c.name for c in chosen}]
        run = LocalRun(chosen, report, stack=args.stack, model_dir=model_dir, port=args.port, left_out=left_out)
    except TwinInputError as err:
        print(f"local: {err}", file=sys.stderr)
        return 2
    breaker = AffinityHangBreaker(
        lambda killed: report.note(SERVICE, killed.line()), on_stuck=lambda stuck: report.note(SERVICE, stuck.line())
    ).start()
    try:
        try:
            run.open_door()
        except OSError as err:
            # Taken between the check above and now.
            print(f"local: {_port_message(args.port, args.stack, err)}", file=sys.stderr)
            return 2
        if not run.start(max_model_len=args.max_model_len, tiny=args.model_dir is None):
            return 1
        run.announce()
        _wait_for_signal()
    finally:
        report.step(SERVICE, "stopping")
        breaker.stop()
        run.stop()
    return 0


def _port_message(port: int, stack: str, err: OSError) -> str:
    from twin.local_announcement import port_taken
    from twin.local_run import free_port_after

    reason = None if err.errno == errno.EADDRINUSE else (err.strerror or type(err).__name__)
    return port_taken(port, stack, free_port_after(port), reason)


if __name__ == "__main__":
    started = time.monotonic()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"local: interrupted after {time.monotonic() - started:.0f}s; stopped", file=sys.stderr)
        sys.exit(130)
