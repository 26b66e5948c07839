"""The model gateway's settings, shared by the render that writes them and the process that reads them.

Kept apart from ``gateway`` so the Pulumi program can build and check them
with pydantic alone (the gateway itself needs aiohttp). They hold where the
API keys are, never the keys.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The environment variable the gateway reads its settings from, as JSON.
SETTINGS_ENV = "INFERENCE_GATEWAY_SETTINGS"


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
    # After SIGTERM, how long new requests are still served (while a load balancer stops sending).
    drain_s: float = Field(default=0.0, ge=0)

    @field_validator("routes")
    @classmethod
    def _urls(cls, routes: dict[str, str]) -> dict[str, str]:
        for model, url in routes.items():
            parts = urlsplit(url)
            bare = parts.path in ("", "/") and not parts.query and not parts.fragment
            if not model or parts.scheme not in ("http", "https") or not parts.hostname or not bare:
                raise ValueError(f"route {model!r}: {url!r} is not an http(s) base URL without a path")
        return {model: url.rstrip("/") for model, url in routes.items()}
