"""The platform's policy pack: `pulumi preview --policy-pack policy` runs it.

Only builds the pack: `PolicyPack(...)` serves the engine and blocks, so
nothing may import this file. The rules live in rules.py, which the CLI
finds because it runs this folder with the folder itself on sys.path.
"""

import rules
from pulumi_policy import EnforcementLevel, PolicyPack

PolicyPack(
    name="llm-platform-guardrails",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=rules.policies(),
)
