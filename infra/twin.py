"""``python -m infra.twin --stack dev|prod``: render a stack offline, then run the local twin of its RayServices.

The twin (``python -m twin``, outside ``infra/``, because it runs Ray and
vLLM) starts a local Ray cluster shaped like every RayService of the render
and checks that Ray's own code accepts and serves what the program declares.
This module imports neither: it validates the stack name, renders it in
process (``infra.render``) and runs the twin with the same interpreter.

Exit codes: 0 every check passed, 1 a check failed, 2 bad input (an unknown
stack, a stack config the program rejects), always one line each.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from infra.render import ROOT, known_stacks, stack_file
from infra.render import main as render_main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; options after ``--`` go to ``python -m twin``."""
    parser = argparse.ArgumentParser(prog="python -m infra.twin", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stack", required=True, help="stack name; reads Pulumi.<stack>.yaml")
    parser.add_argument("--config", type=Path, help="render this stack config file instead")
    parser.add_argument("--out", type=Path, help="render folder (default build/twin/<stack>)")
    parser.add_argument("--static-only", action="store_true", help="only the checks that start nothing")
    parser.add_argument("--keep", action="store_true", help="keep the local clusters' logs")
    parser.add_argument("--monitoring", action="store_true", help="also run Prometheus and the alerts' faults")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; see the module docstring for the exit codes."""
    args = parse_args(argv)
    config = stack_file(args.stack, args.config)
    if args.config is None and args.stack not in known_stacks():
        print(f"twin: unknown stack '{args.stack}': known stacks are {', '.join(known_stacks())}", file=sys.stderr)
        return 2
    out = args.out or ROOT / "build" / "twin" / args.stack
    try:
        rendered = render_main(["--stack", args.stack, "--out", str(out), "--config", str(config)])
    except Exception as err:
        print(f"twin: the render of {args.stack} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if rendered != 0:
        return 2
    command = [sys.executable, "-m", "twin", "--render", str(out), "--stack", args.stack, "--stack-config", str(config)]
    command += ["--static-only"] if args.static_only else []
    command += ["--keep"] if args.keep else []
    command += ["--monitoring"] if args.monitoring else []
    # The twin replaces this process rather than running as its child: a
    # SIGTERM or Ctrl-C (a CI timeout, a person) then reaches the twin itself,
    # which ends every Ray process it started, instead of orphaning it.
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(ROOT)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    sys.exit(main())
