"""The load of one cell, from vLLM's own benchmark client: the code behind ``vllm bench serve``.

Each cell is one call of ``vllm.benchmarks.serve.main_async`` with arguments
parsed by that command's own parser (``add_cli_args``): the random dataset
(64 prompt and 32 output tokens, ``--ignore-eos``, the same seed for every
cell, so every server gets the same prompts), streamed ``/v1/completions``
(the client's default OpenAI backend), ``--max-concurrency c`` with every
request queued at once, so a closed loop of c clients. The API key goes
where the client reads it, ``OPENAI_API_KEY``.

It runs in the harness's process rather than as a ``vllm bench serve``
subprocess per cell: the client's import of vLLM (seconds of CPU) then
happens once, not before every cell, and the harness reads the servers' CPU
counters right around the call. What the client prints goes to a log file
per run; its result dictionary is the cell's figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INPUT_LEN = 64
OUTPUT_LEN = 32
SEED = 0
PERCENTILES = "50,99"


@dataclass(frozen=True)
class Target:
    """Where the client sends its requests."""

    root_url: str  # http://127.0.0.1:<port>, without /v1
    model_id: str
    tokenizer_dir: Path
    api_key: str | None


def client_argv(target: Target, concurrency: int, prompts: int) -> list[str]:
    """``vllm bench serve`` arguments for one cell."""
    return [
        "--backend",
        "openai",
        "--base-url",
        target.root_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        target.model_id,
        "--tokenizer",
        str(target.tokenizer_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--seed",
        str(SEED),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        PERCENTILES,
        "--disable-tqdm",
        # Keeps the per-request lists (errors, output lengths) in the returned result; nothing is written.
        "--save-detailed",
    ]


def parse_args(argv: list[str]) -> Any:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    return parser.parse_args(argv)


@contextlib.contextmanager
def _api_key(key: str | None) -> Any:
    before = os.environ.get("OPENAI_API_KEY")
    if key:
        os.environ["OPENAI_API_KEY"] = key
    else:
        os.environ.pop("OPENAI_API_KEY", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = before


def run(target: Target, concurrency: int, prompts: int, log: Path) -> dict[str, Any]:
    """One cell: vLLM's client against ``target``; returns its result dictionary."""
    from vllm.benchmarks.serve import main_async

    args = parse_args(client_argv(target, concurrency, prompts))
    with (
        _api_key(target.api_key),
        log.open("a") as out,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        print(f"\n=== c={concurrency} prompts={prompts} {target.root_url}", flush=True)
        result: dict[str, Any] = asyncio.run(main_async(args))
    return result


def first_error(result: dict[str, Any]) -> str:
    return next((str(e)[:200] for e in result.get("errors") or () if e), "")


def warm_up() -> None:
    """Imports the client once, outside any cell (vLLM's import takes seconds of CPU)."""
    import vllm.benchmarks.serve  # noqa: F401
