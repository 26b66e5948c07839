"""Rewrites tests/golden/urns-<stack>.txt from the current render: `python -m tests.golden_urns`."""

from __future__ import annotations

from infra.render import ROOT, render
from tests.harness import STACKS


def main() -> None:
    for stack in STACKS:
        urns = sorted({r["urn"] for r in render(stack).resources})
        (ROOT / "tests" / "golden" / f"urns-{stack}.txt").write_text("\n".join(urns) + "\n")
        print(f"{stack}: {len(urns)} URNs")


if __name__ == "__main__":
    main()
