"""The model gateway's settings, shared by the render that writes them and the process that reads them.

Kept apart from ``gateway`` so the Pulumi program can build and check them
with pydantic alone (the gateway itself needs aiohttp). They hold where the
API keys are, never the keys.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The environment variable the gateway reads its settings from, as JSON.
SETTINGS_ENV = "INFERENCE_GATEWAY_SETTINGS"


def _base_url(model: str, url: str, *, path: bool = False) -> str:
    parts = urlsplit(url)
    bare = (path or parts.path in ("", "/")) and not parts.query and not parts.fragment
    if not model or parts.scheme not in ("http", "https") or not parts.hostname or not bare:
        what = "an http(s) URL without a query" if path else "an http(s) base URL without a path"
        raise ValueError(f"route {model!r}: {url!r} is not {what}")
    return url if path else url.rstrip("/")


class Wake(BaseModel):
    """How the gateway wakes one model from zero replicas, and how long it holds that model's requests.

    A model at zero has no pod for its router to send to, so the router
    answers at once that it has no worker. The gateway then sends one request
    to ``url``, the Serve proxy on the model's RayService head: Serve queues
    it at a deployment with no replica, and a queued request is what makes
    Serve's autoscaler start one (its cold-start path). Meanwhile the
    client's request is held, and sent to the router again until a replica
    answers it.
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    # The longest one request is held; then a 503 with Retry-After.
    hold_s: float = Field(gt=0)
    # Requests held at once for this model; more get the 503 at once.
    max_held: int = Field(gt=0)
    # The model's cold-start budget: a 503 asks the client to come back when it should be up.
    cold_start_s: float = Field(gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _base_url("wake", url, path=True)


class GatewaySettings(BaseModel):
    """Where the gateway listens, which router serves each model, where the keys are, and its limits."""

    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(ge=1, le=65535)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Model id -> the base URL of that model's router (scheme, host and port; no path).
    routes: dict[str, str] = Field(min_length=1)
    api_keys_file: str | None
    api_keys_env: str
    # The body cap every replica's guard holds: a larger body is refused here (413).
    max_body_bytes: int = Field(gt=0)
    # The longest a forwarded request may take, its whole answer included.
    request_timeout_s: float = Field(gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # The longest a client may take to send its whole body (408 after): a slow sender must not hold a
    # connection and its handler without end. nginx's default between two reads, as a whole-body bound.
    body_timeout_s: float = Field(default=60.0, gt=0)
    # After SIGTERM, how long new requests are still served (while a load balancer stops sending).
    drain_s: float = Field(default=0.0, ge=0)
    # The models that scale to zero, by model id: how each is woken (a model not here is never held).
    wake: dict[str, Wake] = Field(default_factory=dict)
    # How often a held request is tried on its router again.
    wake_poll_s: float = Field(default=1.0, gt=0)

    @field_validator("routes")
    @classmethod
    def _urls(cls, routes: dict[str, str]) -> dict[str, str]:
        return {model: _base_url(model, url) for model, url in routes.items()}

    @model_validator(mode="after")
    def _woken_models_are_routed(self) -> GatewaySettings:
        unrouted = sorted(set(self.wake) - set(self.routes))
        if unrouted:
            raise ValueError(f"wake names models no route serves: {', '.join(unrouted)}")
        return self
