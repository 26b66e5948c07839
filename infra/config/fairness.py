"""The per-key fairness rule: one API key never holds a whole replica, and the batch worker's key covers its own load.

Across sections: the caps are `serving.fairness`'s (and `batch`'s for the
worker's key), the replica caps the models' or the OpenAI ingress's,
whichever the service's layout puts the guard in.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.config.problems import Problem
from infra.config.stack import StackConfig
from workloads.inference_server.api_keys import BATCH_WORKER_KEY_ID
from workloads.inference_server.catalog import KeyFairness


def key_fairness(cfg: StackConfig) -> KeyFairness:
    """The catalogue's per-key caps: serving.fairness, with the batch worker's key held to its own concurrency.

    A worker keeps batch.messages_per_worker requests in flight, on one
    connection pool to the serve Service: a smaller cap would refuse part of
    every worker's own concurrency at the replica it talks to.
    """
    fairness = cfg.serving.fairness
    if not cfg.batch.enabled or BATCH_WORKER_KEY_ID in fairness.per_key:
        return fairness
    per_key = {**fairness.per_key, BATCH_WORKER_KEY_ID: cfg.batch.messages_per_worker}
    return fairness.model_copy(update={"per_key": per_key})


def replica_inflight_caps(cfg: StackConfig) -> dict[str, tuple[str, int]]:
    """RayService -> (config key, value) of the in-flight cap of the replica its guard runs in.

    vllm-server: the model's max_ongoing_requests (the guard holds it, Serve
    never sees the requests); serve-ingress: the OpenAI ingress replica's.
    """
    caps: dict[str, tuple[str, int]] = {}
    for name, models in cfg.services().items():
        if cfg.layout_for(models) == "vllm-server":
            i = cfg.models.index(models[0])
            caps[name] = (f"models[{i}].autoscaling.max_ongoing_requests", models[0].autoscaling.max_ongoing_requests)
        else:
            caps[name] = ("serving.ingress.max_ongoing_requests", cfg.serving.ingress.max_ongoing_requests)
    return caps


def check_fairness(cfg: StackConfig) -> Iterable[Problem]:
    """Every key cap stays below every replica cap, and the batch worker's covers its own concurrency."""
    fairness = key_fairness(cfg)
    derived = fairness is not cfg.serving.fairness
    for key_id, cap in fairness.caps().items():
        if key_id == "*":
            path = "serving.fairness.max_inflight_per_key"
        elif derived and key_id == BATCH_WORKER_KEY_ID:
            path = "batch.messages_per_worker"
        else:
            path = f"serving.fairness.per_key.{key_id}"
        for service, (replica_path, replica_cap) in replica_inflight_caps(cfg).items():
            if cap >= replica_cap:
                yield Problem(
                    path,
                    f"{cap} is not below {replica_path} ({replica_cap}) of service '{service}': one key at its cap "
                    "would hold the whole replica and every other key would get 429",
                )
                break
    batch_cap = cfg.serving.fairness.per_key.get(BATCH_WORKER_KEY_ID)
    if cfg.batch.enabled and batch_cap is not None and batch_cap < cfg.batch.messages_per_worker:
        yield Problem(
            f"serving.fairness.per_key.{BATCH_WORKER_KEY_ID}",
            f"{batch_cap} is below batch.messages_per_worker ({cfg.batch.messages_per_worker}): each batch worker "
            "would be refused part of its own concurrency at the replica it talks to",
        )
