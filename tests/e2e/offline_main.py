"""Greedy reference output from vLLM's own offline engine, as JSON on the last stdout line.

Runs in its own process so its engine shares nothing with the server's.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-bytes", type=int, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model_dir,
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    output = llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0]
    print(json.dumps({"text": output.text, "token_ids": list(output.token_ids)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
