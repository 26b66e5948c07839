"""Loads a model with vLLM's offline engine and prints the greedy output and the load times as JSON.

Run twice by tests/e2e/test_s3_weights_e2e.py: once from s3:// through
runai_streamer (the production path), once from a local directory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

# The default loader logs its time; runai_streamer only a progress bar
# ("21/21 [00:00<00:00, 193.24it/s]"): tensors / rate is its time.
WEIGHTS_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")
STREAMER_BAR = re.compile(r"Runai Model Streamer: 100% Completed \| (\d+)/\d+ \[[^,\]]*, ([0-9.]+)it/s\]")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-kwargs", required=True, help="JSON: vLLM engine keyword arguments")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, **json.loads(args.engine_kwargs))
    engine_seconds = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    output = llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0]
    result = {"text": output.text, "token_ids": list(output.token_ids), "engine_seconds": engine_seconds}
    print(json.dumps(result), flush=True)
    return 0


def weights_seconds(log: Path) -> float | None:
    """The weights' load time from a run's log: vLLM's own line, else the streamer's progress bar."""
    text = log.read_text(errors="replace")
    found = WEIGHTS_LINE.findall(text)
    if found:
        return float(found[-1])
    bars = STREAMER_BAR.findall(text)
    return round(int(bars[-1][0]) / float(bars[-1][1]), 3) if bars else None


if __name__ == "__main__":
    sys.exit(main())
