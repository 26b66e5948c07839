"""The e2e launcher (``localserve/serve_main.py``) serving *stock* Ray Serve LLM: no guard, no server subclass.

Same catalogue, same engine arguments (``inference_server.engine.llm_config_kwargs``),
same Ray and Serve start-up; only ``build_app`` is swapped for Ray Serve LLM's
plain ``build_openai_app``. Set beside the project's server, it splits the
overhead into what the project adds (project - stock) and what Ray Serve adds
(stock - bare vLLM).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "workloads"), str(REPO)]


def build_stock_app(args: dict[str, Any]) -> Any:
    from inference_server.catalog import Catalog
    from inference_server.engine import llm_config_kwargs
    from ray.serve.llm import LLMConfig, build_openai_app

    catalog = Catalog.model_validate(args)
    configs = [LLMConfig(**llm_config_kwargs(entry, catalog)) for entry in catalog.models]
    return build_openai_app({"llm_configs": configs})


if __name__ == "__main__":
    import inference_server.app

    from localserve import serve_main

    # serve_main imports build_app from this module when it runs.
    inference_server.app.build_app = build_stock_app
    sys.exit(serve_main.main())
