"""One rank of a replica loading its weights with vLLM's runai_streamer loader, without the rest of the engine.

Run by tests/e2e/test_s3_weights_e2e.py, once per rank: joins a gloo
process group (what vLLM's CPU workers use), then for each source hands
vLLM's RunaiModelStreamerLoader the given model_loader_extra_config and
loads through its `load_weights`, the call vLLM's workers make, into a
stand-in model that only fingerprints every tensor. Prints one JSON line:
{"rank": r, "tensors": {source: {name: sha256 of its bytes}}}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any


class Fingerprints:
    """Stands in for the model: vLLM calls `load_weights` with the iterator of (name, tensor)."""

    def __init__(self) -> None:
        self.tensors: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        import torch

        for name, tensor in weights:
            data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
            self.tensors[name] = hashlib.sha256(data).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="torch.distributed init method (file://...)")
    parser.add_argument("--source", action="append", required=True, help="s3://bucket/prefix; repeatable")
    parser.add_argument("--extra-config", action="append", required=True, help="JSON, one per --source")
    args = parser.parse_args()

    import torch.distributed as dist
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.runai_streamer_loader import RunaiModelStreamerLoader

    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.world_size)
    loaded: dict[str, dict[str, str]] = {}
    for source, extra in zip(args.source, args.extra_config, strict=True):
        config = LoadConfig(load_format="runai_streamer", model_loader_extra_config=json.loads(extra))
        model = Fingerprints()
        model_config = SimpleNamespace(model=source, model_weights=None, revision=None)
        # Duck-typed stand-ins: load_weights reads only model_config's model, model_weights and revision,
        # and calls model.load_weights (runai_streamer_loader.py `load_weights`).
        RunaiModelStreamerLoader(config).load_weights(model, model_config)  # type: ignore[arg-type]
        loaded[source] = model.tensors
        # The next source starts together on every rank, as one engine's load would.
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "tensors": loaded}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
