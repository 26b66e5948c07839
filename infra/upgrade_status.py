"""Where each RayService's upgrade stands: one line per RayService, its phase and the likely cause.

    python -m infra.upgrade_status --namespace llm [--context CTX]
    python -m infra.upgrade_status --stack prod [--config FILE] [--context CTX]
    make upgrade-status STACK=prod [CONTEXT=ctx]

Run it when `pulumi up` times out waiting for a RayService (its
`pulumi.com/timeoutSeconds`), or any time. It reads the namespace with
`kubectl get rayservices,pods,events -o json` (the kubectl and kubeconfig of
the machine it runs on; --stack reads the namespace, and for `cluster.mode:
existing` the context, from Pulumi.<stack>.yaml) and prints, e.g.:

    llm/llama-33-70b: pending-cluster-starting: no GPU capacity: 2 of the new cluster's 3 pods are Pending (...)

Exit 0 when every RayService is steady, 1 when any is not, 2 when it could
not ask (no kubectl, no access, a bad stack file), with one line saying why.
The phases are documented in docs/changing-a-running-stack.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.serving.upgrade_status import diagnose_list, exit_code, one_line

PROG = "python -m infra.upgrade_status"
KUBECTL_TIMEOUT_SECONDS = 60
CANNOT_ASK = 2
# client-go's log lines, which kubectl prints before its own message.
KLOG_LINE = re.compile(r"^[IWEF]\d{4} ")


class CannotAskError(RuntimeError):
    """The cluster could not be read; the message is the one line to print."""


def kubectl_get(namespace: str, context: str | None = None) -> dict[str, Any]:
    """`kubectl get rayservices,pods,events -n NS -o json`, parsed; raise CannotAskError with one line."""
    command = ["kubectl", *(["--context", context] if context else []), "get", "rayservices,pods,events"]
    command += ["-n", namespace, "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_SECONDS, check=False)
    except FileNotFoundError as err:
        raise CannotAskError(
            "kubectl is not installed or not on PATH: install it and point it at the cluster "
            "(aws eks update-kubeconfig --name $(pulumi stack output cluster_name))"
        ) from err
    except subprocess.TimeoutExpired as err:
        raise CannotAskError(f"kubectl did not answer within {KUBECTL_TIMEOUT_SECONDS} s: {' '.join(command)}") from err
    if done.returncode != 0:
        raise CannotAskError(
            f"{' '.join(command)} failed: {one_line(kubectl_error(done.stderr, done.returncode), 300)}"
        )
    try:
        listing = json.loads(done.stdout)
    except json.JSONDecodeError as err:
        raise CannotAskError(f"{' '.join(command)} did not print JSON: {err}") from err
    if not isinstance(listing, dict):
        raise CannotAskError(f"{' '.join(command)} did not print a List")
    return listing


def kubectl_error(stderr: str, returncode: int) -> str:
    """kubectl's own message: its last line that is not a client-go log line (`E1203 01:46:01.09 ...`)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if not KLOG_LINE.match(line)]
    return (said or lines or [f"exit code {returncode}"])[-1]


def stack_target(stack: str, config: Path | None) -> tuple[str, str | None]:
    """The serving namespace of a stack, and its kubeconfig context when the stack names one."""
    from infra.config import ConfigError, load_stack_file
    from infra.render import stack_file

    path = stack_file(stack, config)
    if not path.is_file():
        raise CannotAskError(f"config error: {path}: no such stack config file")
    try:
        cfg = load_stack_file(path)
    except ConfigError as err:
        raise CannotAskError(one_line(str(err))) from err
    return cfg.serving.namespace, cfg.cluster.kubeconfig_context


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--namespace", "-n", help="the namespace the RayServices run in")
    where.add_argument("--stack", help="read the namespace (and context) from Pulumi.<stack>.yaml")
    parser.add_argument("--config", type=Path, help="with --stack: this stack config file instead")
    parser.add_argument("--context", help="the kubeconfig context (default: kubectl's current one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    args = parse_args(argv)
    try:
        namespace, context = (args.namespace, None) if args.namespace else stack_target(args.stack, args.config)
        listing = kubectl_get(namespace, args.context or context)
    except CannotAskError as err:
        print(f"upgrade-status: {err}", file=sys.stderr)
        return CANNOT_ASK
    diagnoses = diagnose_list(listing, now=datetime.now(UTC))
    if not diagnoses:
        print(f"upgrade-status: no RayService in namespace {namespace} (wrong namespace or context?)", file=sys.stderr)
        return CANNOT_ASK
    for diagnosis in diagnoses:
        print(diagnosis.line())
    return exit_code(diagnoses)


if __name__ == "__main__":
    sys.exit(main())
