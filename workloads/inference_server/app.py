"""The Ray Serve application: Ray Serve LLM's OpenAI app behind API keys and request limits.

``serveConfigV2`` names ``inference_server.app:build_app`` as the import path
and passes the catalogue as ``args``. Ray Serve LLM does the serving (OpenAI
routes, streaming, engine lifecycle, placement groups); this module only maps
the catalogue onto ``LLMConfig`` and puts :class:`~inference_server.guard.ApiGuard`
in front of the ingress' routes.

The default layout for a single-model service is "vllm-server"
(``vllm_server.py``): Serve places and scales vLLM's own OpenAI server and no
request passes through Serve. The catalogue's ``layout: serve-ingress`` runs
Ray Serve LLM's request path instead, from Ray Serve LLM's own builder: an
``OpenAiIngress`` deployment routes to one ``LLMServer`` deployment per
model, and the guard runs in the ingress replica.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_openai_app
from ray.serve.llm.deployment import LLMServer as _RayLLMServer
from ray.serve.llm.ingress import OpenAiIngress

from .catalog import Catalog, KeyFairness, RequestLimits, ServeAutoscaling
from .engine import ingress_deployment_config, llm_config_kwargs
from .fairness import KeyAccounting, RayKeyMetrics
from .guard import ApiGuard, ApiKeys, tokenize_requests

logger = logging.getLogger(__name__)


class GuardSettings(BaseModel):
    """What a replica needs to build its guard. Holds key locations, never keys."""

    model_config = ConfigDict(extra="forbid")

    api_keys_file: str | None
    api_keys_env: str
    limits: RequestLimits
    # The served model names: a request for any other gets an OpenAI-shaped 404 from the guard.
    model_ids: list[str] = []
    fairness: KeyFairness = Field(default_factory=KeyFairness)
    # The guard's replica's max_ongoing_requests (Catalog.replica_inflight_cap).
    replica_inflight_cap: int = Field(default=ServeAutoscaling().max_ongoing_requests, ge=1)

    @classmethod
    def from_catalog(cls, catalog: Catalog) -> GuardSettings:
        return cls(
            api_keys_file=catalog.api_keys_file,
            api_keys_env=catalog.api_keys_env,
            limits=catalog.limits,
            model_ids=[m.model_id for m in catalog.models],
            fairness=catalog.fairness,
            replica_inflight_cap=catalog.replica_inflight_cap(),
        )

    def keys(self) -> ApiKeys:
        keys = ApiKeys(self.api_keys_file, self.api_keys_env)
        if not len(keys):
            logger.warning(
                "No API keys found in %s or $%s: every request will be refused", self.api_keys_file, self.api_keys_env
            )
        return keys


def _tokenize_request(model_id: str, path: str, body: dict[str, Any]) -> list[Any]:
    """Tokenize requests that measure a generation request's prompt(s)."""
    # Ray Serve LLM 2.60 exports no public alias for the tokenize models; these
    # are the ones its own ingress and LLMServer.tokenize take.
    from ray.llm._internal.serve.core.configs.openai_api_models import (
        TokenizeChatRequest,
        TokenizeCompletionRequest,
    )

    return tokenize_requests(path, body, model_id, TokenizeChatRequest, TokenizeCompletionRequest)


@cache
def _key_metrics() -> RayKeyMetrics:
    """The per-key counters, once per replica process, exported by Ray's metrics agent."""
    return RayKeyMetrics()


def _install_guard(app: Any, settings: GuardSettings, counter: Any) -> None:
    """Put the guard, and the per-key accounting around it, outermost on a FastAPI app, even a built one."""
    app.middleware_stack = None  # let Starlette rebuild the stack with the guard
    keys = settings.keys()
    app.add_middleware(
        ApiGuard,
        keys=keys,
        limits=settings.limits,
        model_ids=settings.model_ids,
        count_prompt_tokens=counter,
    )
    # Added last, so outermost: it sees the guard's refusals too, and one keys file serves both.
    app.add_middleware(
        KeyAccounting,
        keys=keys,
        fairness=settings.fairness,
        replica_cap=settings.replica_inflight_cap,
        model_ids=settings.model_ids,
        default_model=settings.model_ids[0] if len(settings.model_ids) == 1 else None,
        metrics=_key_metrics(),
    )


class GuardedOpenAiIngress(OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress with the guard in front of its routes."""

    def __init__(self, llm_deployments: Any, model_cards: Any, *, guard: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._guard_settings = GuardSettings.model_validate(guard)

    async def _count_prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """One exact count per prompt, by the model's LLMServer; None when it answered with an error."""
        model_id = await self._get_model_id(body.get("model"))
        counts = []
        for request in _tokenize_request(model_id, path, body):
            async for response in self._get_response(body=request, call_method="tokenize"):
                count = getattr(response, "count", None)
                if count is None:
                    return None
                counts.append(count)
                break
        return counts

    async def __serve_build_asgi_app__(self) -> Any:
        # Serve calls this hook once per replica, after __init__ and before
        # the first request: the app is ours to wrap here.
        app = self.app
        _install_guard(app, self._guard_settings, self._count_prompt_tokens)
        return app


class LLMServer(_RayLLMServer):
    """Ray Serve LLM's model server, with its ``tokenize`` mended.

    Ray 2.60 looks up vLLM's tokenization service under the name vLLM used
    before 0.29 (``openai_serving_tokenization``; vLLM 0.29 calls it
    ``serving_tokenization``), so ``tokenize`` always failed. The exact
    prompt count of the guard needs it: :meth:`start` wires it up.

    Named ``LLMServer`` like its base so deployments stay "LLMServer:<model>"
    in Serve's metrics and dashboards.
    """

    async def start(self) -> None:
        await super().start()
        engine = self.engine
        if engine is not None and getattr(engine, "_oai_serving_tokenization", False) is None:
            state = getattr(engine, "_app_state", None)
            engine._oai_serving_tokenization = getattr(state, "serving_tokenization", None)


def llm_configs(catalog: Catalog) -> list[LLMConfig]:
    configs = []
    for entry in catalog.models:
        kwargs = llm_config_kwargs(entry, catalog)
        kwargs["server_cls"] = LLMServer
        configs.append(LLMConfig(**kwargs))
    return configs


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``args`` is the catalogue (serveConfigV2 ``args``)."""
    catalog = Catalog.model_validate(args)
    if catalog.layout == "vllm-server":
        from .vllm_server import build_vllm_server_app

        logger.info("Building the vllm-server app for %s", catalog.models[0].model_id)
        return build_vllm_server_app(catalog)
    serving_args: dict[str, Any] = {
        "llm_configs": llm_configs(catalog),
        "ingress_cls_config": {
            "ingress_cls": GuardedOpenAiIngress,
            "ingress_extra_kwargs": {"guard": GuardSettings.from_catalog(catalog).model_dump()},
        },
        "ingress_deployment_config": ingress_deployment_config(catalog),
    }
    logger.info("Building the OpenAI app for %s (OpenAiIngress ingress)", [m.model_id for m in catalog.models])
    return build_openai_app(serving_args)
