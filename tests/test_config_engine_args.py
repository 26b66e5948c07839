"""The vLLM engine arguments the config accepts are the pinned vLLM's own.

`infra/vllm_engine_args.json` holds the names Ray Serve LLM lets through to
vLLM in a model's `engine_kwargs` (the fields of vLLM's `AsyncEngineArgs` and
`FrontendArgs`; any other name stops the replica at start). The program can
not import vLLM, so the list is data; this test compares it with the
installed vLLM (skipped without it, failed under E2E_REQUIRED=1) and writes
it anew after a vLLM upgrade:

    venv/bin/python -m tests.test_config_engine_args
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from infra import versions
from infra.config import vllm_engine_args
from infra.render import ROOT

DATA = ROOT / "infra" / "vllm_engine_args.json"
# Run in a child: importing vLLM is slow and loads torch.
_LIST_FIELDS = """
import dataclasses, json
import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import FrontendArgs
print(json.dumps({
    "vllm_version": vllm.__version__.split("+")[0],
    "engine_args": sorted(f.name for f in dataclasses.fields(AsyncEngineArgs)),
    "frontend_args": sorted(f.name for f in dataclasses.fields(FrontendArgs)),
}))
"""
_SOURCE = (
    "dataclasses.fields of vllm.engine.arg_utils.AsyncEngineArgs and vllm.entrypoints.launchers.cli_args."
    "FrontendArgs: the names Ray Serve LLM accepts in engine_kwargs. Written by "
    "`venv/bin/python -m tests.test_config_engine_args`."
)


def installed_fields() -> dict[str, Any]:
    """The installed vLLM's version and argument names."""
    result = subprocess.run(
        [sys.executable, "-c", _LIST_FIELDS], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail("E2E_REQUIRED=1 but vllm is not installed")
        pytest.skip("vllm is not installed (workloads/requirements-e2e.txt)")


def _pinned_e2e_vllm() -> str:
    text = (ROOT / "workloads" / "requirements-e2e.txt").read_text()
    match = re.search(r"^vllm(-cpu)?==(\S+)$", text, re.MULTILINE)
    assert match, "workloads/requirements-e2e.txt pins no vllm"
    return match[2]


def test_committed_list_is_for_the_pinned_vllm() -> None:
    version, known = vllm_engine_args()
    assert version == versions.VLLM_VERSION == _pinned_e2e_vllm()
    # The arguments the prod stack overrides, and the typed fields' own names.
    assert {"enable_prefix_caching", "max_num_seqs", "tensor_parallel_size", "max_model_len"} <= known


def test_committed_list_equals_the_installed_vllm() -> None:
    _require_vllm()
    installed = installed_fields()
    assert installed["vllm_version"] == versions.VLLM_VERSION, "the installed vLLM is not the pinned one"
    committed = json.loads(DATA.read_text())
    for key in ("engine_args", "frontend_args"):
        assert committed[key] == installed[key], f"{key} changed: rewrite with python -m tests.test_config_engine_args"


def main() -> None:
    """Write infra/vllm_engine_args.json from the installed vLLM."""
    fields = installed_fields()
    data = {"vllm_version": fields["vllm_version"], "source": _SOURCE, **fields}
    DATA.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {DATA.relative_to(ROOT)}: vLLM {data['vllm_version']}, {len(data['engine_args'])} engine args")


if __name__ == "__main__":
    main()
