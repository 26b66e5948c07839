"""What ``python -m twin.local`` prints for a person once the stack answers, and when its port is taken.

Pure functions of the stack's rendered config and of what the run found
running, so the text can be checked for every stack without starting
anything: one base URL, the key, the models, and only the notes that hold
for the models this run serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twin.checks import catalog_layout

# What Serve's autoscaling takes when a catalogue leaves it out (inference_server.catalog.ServeAutoscaling).
DEFAULT_MIN_REPLICAS = 1
DEFAULT_DOWNSCALE_DELAY_S = 600.0


@dataclass(frozen=True)
class ServedModel:
    """One model of the run, as its RayService's rendered catalogue declares it."""

    service: str
    model_id: str
    min_replicas: int
    downscale_delay_s: float
    layout: str


def served_models(service: str, serve_config: Mapping[str, Any]) -> list[ServedModel]:
    """The models of one RayService's rendered ``serveConfigV2``, in catalogue order.

    The local run keeps the rendered replica bounds and scale-down delays, so
    these are what the running models do.
    """
    found = []
    for app in serve_config.get("applications") or []:
        catalog = app.get("args") or {}
        for entry in catalog.get("models") or []:
            scaling = entry.get("autoscaling") or {}
            found.append(
                ServedModel(
                    service=service,
                    model_id=str(entry.get("model_id")),
                    min_replicas=int(scaling.get("min_replicas", DEFAULT_MIN_REPLICAS)),
                    downscale_delay_s=float(scaling.get("downscale_delay_s", DEFAULT_DOWNSCALE_DELAY_S)),
                    layout=catalog_layout(catalog),
                )
            )
    return found


@dataclass(frozen=True)
class Metrics:
    """A metrics endpoint found running (a vllm-server replica publishes its own), for the person to scrape."""

    url: str
    model_id: str


def notes(models: Sequence[ServedModel], left_out: Sequence[str]) -> list[str]:
    """The notes that hold for this run's models, one line each; Ctrl-C's last."""
    lines = [
        f"{m.model_id} is at min_replicas 0: it goes to zero after {m.downscale_delay_s:g}s without requests "
        "(its downscale_delay_s), and the next request wakes it"
        + (" through the model gateway, which holds it" if m.layout == "vllm-server" else "")
        + " (a worker node and its engine start: about a minute)."
        for m in models
        if m.min_replicas == 0
    ]
    services = sorted({m.service for m in models})
    if len(services) > 1:
        lines.append(
            f"Deployed, each RayService ({', '.join(services)}) has its own endpoint; here one front door "
            "sends each request to the replicas of the model it names."
        )
    if left_out:
        lines.append(
            f"Not running: the stack's RayService {', '.join(left_out)} (without --service every RayService runs)."
        )
    lines.append("Ctrl-C stops everything.")
    return lines


def announcement(
    base_url: str,
    api_key: str,
    models: Sequence[ServedModel],
    *,
    metrics: Sequence[Metrics] = (),
    left_out: Sequence[str] = (),
) -> str:
    """The text printed once every model answered: what a person needs to use the stack.

    The key is printed because it was generated for this run and lives only
    in the run's temporary keys file; it never appears in a process argument.
    """
    ids = [m.model_id for m in models]
    label = "vLLM metrics:"
    metric_lines = [f"  {label if i == 0 else '':<17}{m.url} ({m.model_id})" for i, m in enumerate(metrics)]
    lines = [
        "",
        f"  OpenAI base URL: {base_url}",
        f"  API key:         {api_key}",
        f"  models:          {', '.join(ids)}",
        *metric_lines,
        "",
        f"  curl {base_url}/chat/completions -H 'Authorization: Bearer {api_key}' \\",
        f'    -H \'Content-Type: application/json\' -d \'{{"model": "{ids[0]}", '
        '"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}\'',
        "",
        *(f"  {line}" for line in notes(models, left_out)),
        "",
    ]
    return "\n".join(lines)


def port_taken(port: int, stack: str, free: int | None, reason: str | None = None) -> str:
    """The one line for a port the run can not listen on: why, and how to pick another.

    ``reason``: the system's word when the port is not simply in use (e.g. "Permission denied").
    """
    other = str(free) if free is not None else "<port>"
    why = (
        "is taken (another program listens there): stop it, or pick another port"
        if reason is None
        else f"can not be listened on ({reason}): pick another port"
    )
    return (
        f"127.0.0.1:{port} {why}, e.g. make local STACK={stack} PORT={other} "
        f"(python -m twin.local --stack {stack} --port {other})"
    )
