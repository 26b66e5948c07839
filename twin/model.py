"""The tiny random-weight model the twin serves, built once and shared.

Built by the local server's own builder (:mod:`localserve.tiny_model`) into
``build/tiny-model/<version>``, where the end-to-end tests, the twin runs and
the local run all find it. It is built in a scratch directory and renamed
into place, so a concurrent run never reads half a model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from localserve.server import TINY_MODEL, build_tiny_model

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = REPO / "build" / "tiny-model"


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a model vLLM can load (config, weights, tokenizer)."""
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer_config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def tiny_model_dir(cache_root: Path = CACHE_ROOT) -> Path:
    """The tiny model's directory; built on first use (about 20 s), then reused."""
    version = hashlib.sha256(TINY_MODEL.read_bytes()).hexdigest()[:12]
    target = cache_root / f"tiny-llama-{version}"
    if is_model_dir(target):
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_root))
    try:
        build_tiny_model(scratch / "model")
        try:
            os.rename(scratch / "model", target)
        except OSError:
            if not is_model_dir(target):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
