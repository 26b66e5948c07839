"""Ray Serve autoscaling on vLLM's own queue ("vllm-server" layout).

Requests never pass through Serve there, so Serve's built-in count of
ongoing requests stays at zero. Each replica reports vLLM's running plus
waiting requests as a custom metric (``VllmServer.record_autoscaling_stats``)
and this policy applies Serve's own queue-length rule to it: as many
replicas as keep ``target_ongoing_requests`` per replica. Serve wraps a
custom policy with the deployment's bounds, scaling factors and up/down
delays, so those keep their meaning.

Imported by Serve's controller by path and pickled by value: nothing heavier
than the standard library may be imported here.
"""

from __future__ import annotations

from typing import Any

# The custom metric each replica reports, and the policy's import path.
ONGOING_METRIC = "vllm_ongoing_requests"
POLICY_PATH = "inference_server.autoscale:ongoing_requests_policy"


def ongoing_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas from the replicas' reported vLLM queues (``ray.serve.config.AutoscalingContext``)."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    reported = (ctx.aggregated_metrics or {}).get(ONGOING_METRIC) or {}
    if not reported:
        # No replica has reported yet (just started): hold, rather than read
        # silence as an idle fleet and scale it down.
        return ctx.target_num_replicas, {}
    # A replica that has not reported yet counts as holding the mean of those that have.
    mean = sum(reported.values()) / len(reported)
    total = mean * ctx.current_num_replicas
    return total / ctx.config.get_target_ongoing_requests(), {}
