"""The capacity and cost plan of a stack, offline: what each model's replica holds and costs.

    python -m infra.plan --stack dev [--config FILE] [--markdown | --json]

Reads Pulumi.<stack>.yaml, applies the config rules (a config error prints
one line per problem and exits 2) and prints one row per model: weights and
KV cache per GPU, KV tokens, max_model_len sequences, the recommended
max_num_seqs, and the estimated decode rate and cost, with the assumptions
behind every estimate. --markdown prints the table the pull request's
preview comment shows; --json the `capacity` stack output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infra.capacity.report import cold_start_line, markdown, plan_stack, stack_output, text
from infra.config import ConfigError, capacity_input, load_stack_file
from infra.render import stack_file


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m infra.plan", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stack", required=True, help="stack name; reads Pulumi.<stack>.yaml")
    parser.add_argument("--config", type=Path, help="plan this stack config file instead")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--markdown", action="store_true", help="a Markdown table (the preview comment's)")
    form.add_argument("--json", action="store_true", help="the `capacity` stack output as JSON")
    args = parser.parse_args(argv)
    path = stack_file(args.stack, args.config)
    if not path.is_file():
        print(f"config error: {path}: no such stack config file", file=sys.stderr)
        return 2
    try:
        cfg = load_stack_file(path)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    inputs = capacity_input(cfg)
    plans = plan_stack(inputs)
    if args.json:
        print(json.dumps(stack_output(inputs, plans), indent=2, sort_keys=True))
    else:
        print((markdown if args.markdown else text)(args.stack, inputs, plans), end="")
        if not args.markdown:
            # The cold-start budget per model, as the preview prints it.
            print("", *(cold_start_line(p.model.cold_start) for p in plans), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
