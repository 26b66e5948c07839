"""Shared helpers: render a stack under mocks once per session and look things up."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra.render import ROOT, Rendered, render

STACKS = sorted(p.name.split(".")[1] for p in ROOT.glob("Pulumi.*.yaml"))
REFERENCE = ROOT.parent / "shared" / "reference"


@cache
def render_stack(stack: str) -> Rendered:
    """The render of a committed stack (cached: treat it as read-only)."""
    return render(stack)


def render_config(doc: dict[str, Any], stack: str = "custom") -> Rendered:
    """Render a stack file given as a dict (the `config:` document)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"Pulumi.{stack}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return render(stack, path)


def stack_doc(stack: str) -> dict[str, Any]:
    """A committed stack file as a dict, to copy and break in tests."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())
    return doc


def by_type(rendered: Rendered, type_token: str) -> list[dict[str, Any]]:
    """Resources of one Pulumi type."""
    return [r for r in rendered.resources if r["type"] == type_token]


def manifests_of(rendered: Rendered, kind: str) -> list[dict[str, Any]]:
    """Kubernetes objects of one kind."""
    return [m for m in rendered.manifests if m.get("kind") == kind]


def release(rendered: Rendered, chart: str) -> dict[str, Any]:
    """The Helm release of one chart."""
    found = [h for h in rendered.helm if h["chart"] == chart]
    assert len(found) == 1, f"expected one release of {chart}, found {len(found)}"
    return found[0]
