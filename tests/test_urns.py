"""Resource URNs are the identity Pulumi keeps state under: a changed URN is a
delete and a create, which for a protected bucket or a cluster loses data.

`tests/golden/urns-<stack>.txt` lists every URN the program declares, in the
engine's form. A refactor may change a URN only if the new resource carries
an alias to the old one; a new or removed resource is accepted by rewriting
the list (`make golden-urns`) in the same commit, where a reviewer sees it.
"""

from __future__ import annotations

import pytest

from infra.render import ROOT
from tests.harness import STACKS, render_stack

GOLDEN = ROOT / "tests" / "golden"


def golden_urns(stack: str) -> list[str]:
    return [line for line in (GOLDEN / f"urns-{stack}.txt").read_text().splitlines() if line]


@pytest.mark.parametrize("stack", STACKS)
def test_no_urn_changes_without_an_alias(stack: str) -> None:
    resources = render_stack(stack).resources
    current = {r["urn"] for r in resources}
    aliased = {a for r in resources for a in r.get("aliases", [])}
    lost = [u for u in golden_urns(stack) if u not in current and u not in aliased]
    assert not lost, "URNs changed without an alias (Pulumi would replace these resources):\n" + "\n".join(lost)


@pytest.mark.parametrize("stack", STACKS)
def test_golden_list_is_current(stack: str) -> None:
    current = sorted({r["urn"] for r in render_stack(stack).resources})
    new = sorted(set(current) - set(golden_urns(stack)))
    assert not new, "resources not in the golden list (accept them with `make golden-urns`):\n" + "\n".join(new)


@pytest.mark.parametrize("stack", STACKS)
def test_urns_are_unique(stack: str) -> None:
    urns = [r["urn"] for r in render_stack(stack).resources]
    assert len(urns) == len(set(urns))


def test_engine_urns_chain_every_ancestor() -> None:
    by_name = {r["name"]: r for r in render_stack("dev").resources if r["type"] == "aws:kms/key:Key"}
    assert by_name["model-bucket-key"]["urn"] == (
        "urn:pulumi:dev::llm-platform::llm-platform:aws:ModelBucket$aws:kms/key:Key::model-bucket-key"
    )
