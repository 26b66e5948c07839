"""The Pulumi program: read the config once, then wire the layers."""

import sys
from pathlib import Path

# With `main: infra/` the CLI runs this file with infra/ itself first on
# sys.path. Put the project root there instead, so the program imports as
# the package `infra` exactly as the tests and the render do, and so
# infra/platform can not shadow the standard library's `platform`.
_INFRA = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _INFRA]
sys.path.insert(0, str(_INFRA.parent))

import pulumi  # noqa: E402

from infra.config import ConfigError, load  # noqa: E402
from infra.stack import build_stack  # noqa: E402

try:
    loaded = load()
except ConfigError as err:
    # RunError ends the program with the message alone, no traceback.
    raise pulumi.RunError(str(err)) from None
build_stack(loaded)
