"""The platform as a table of parts: adding or swapping one is one entry in `build.PARTS`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pulumi

from infra.aws.layer import AwsLayer
from infra.config import StackConfig


@dataclass(frozen=True)
class PartContext:
    """What a part is built from: the config, the AWS layer and the parts already installed."""

    cfg: StackConfig
    aws: AwsLayer
    installed: Mapping[str, pulumi.ComponentResource]


@dataclass(frozen=True)
class Part:
    """One in-cluster service of the platform layer.

    `name` is its Pulumi resource name, `enabled` says whether this stack
    installs it, `build` declares it (with the provider and what it waits
    for in the options it is given), and `after` names the parts whose
    resources must exist first (a CRD it uses, a webhook that intercepts it).
    """

    name: str
    enabled: Callable[[PartContext], bool]
    build: Callable[[str, PartContext, pulumi.ResourceOptions], pulumi.ComponentResource]
    after: tuple[str, ...] = ()
