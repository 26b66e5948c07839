"""The Pulumi program. `Pulumi.yaml` names no `main:`, so the CLI runs this
file from the project root, with the root first on sys.path: the program
imports as the package `infra`, exactly as the tests and the render do."""

import pulumi

from infra.config import ConfigError, load
from infra.stack import build_stack

try:
    loaded = load()
except ConfigError as err:
    # RunError ends the program with the message alone, no traceback.
    raise pulumi.RunError(str(err)) from None
build_stack(loaded)
