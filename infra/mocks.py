"""Pulumi mocks for the offline render and the unit tests.

Every resource gets its inputs back as outputs, plus a stable id and ARN.
Remote components (pulumi-eks, awsx) and resources whose outputs the
program reads (kubeconfigs, subnet ids, image digests) get those outputs
from `TYPE_OUTPUTS`, computed from the logical name so that the same
program always renders the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pulumi

ACCOUNT_ID = "123456789012"

OutputFn = Callable[[str, dict[str, Any], str], dict[str, Any]]


def fake_digest(name: str) -> str:
    """A deterministic sha256 digest for a name."""
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def _arn(service: str, region: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT_ID}:{resource}"


# Outputs per type token; each returns the extra outputs for (name, inputs, region).
TYPE_OUTPUTS: dict[str, OutputFn] = {}


class PlatformMocks(pulumi.runtime.Mocks):
    """Mocks that echo inputs and fill the outputs the program reads."""

    def __init__(self, region: str = "us-east-1") -> None:
        self.region = region

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        state = dict(args.inputs)
        service = args.typ.split(":")[1].split("/")[0] if ":" in args.typ else "mock"
        state.setdefault("arn", _arn(service, self.region, args.name))
        extra = TYPE_OUTPUTS.get(args.typ)
        if extra is not None:
            state.update(extra(args.name, dict(args.inputs), self.region))
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT_ID, "arn": _arn("iam", "", "root"), "userId": ACCOUNT_ID}, None
        if args.token == "aws:index/getRegion:getRegion":
            return {"name": self.region, "region": self.region, "id": self.region}, None
        if args.token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com"}, None
        return dict(args.args), None
