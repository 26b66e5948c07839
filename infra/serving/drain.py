"""How long a Ray worker keeps serving once it is told to stop.

One budget, `longest_generation_seconds`: the longest request the limits
allow, decoded at the slowest pace the platform is sized for. That pace is
the SLO's: the first token within `slo.ttft_p95_seconds`, then
`serving.limits.max_tokens` tokens at `slo.inter_token_p95_seconds` each (a
minimum decode rate of 1 / inter_token_p95 tokens per second; the same bound
the config's batch visibility rule uses). Every way a request can be cut
off is given at least that long:

- Serve stops a replica (scale-down, a replica moved off a draining node)
  gracefully: it takes no new requests and waits up to
  `graceful_shutdown_timeout_s` = the budget for the ones it holds;
- a Ray worker pod being deleted (a node drain, a NewCluster upgrade
  removing the old cluster) runs a preStop hook first. It drains its Ray
  node, so Serve starts replacement replicas elsewhere, stops this node's
  replicas gracefully and drains this node's proxy (readiness fails, the
  load balancer stops sending), then waits until no Serve replica or proxy
  is left on the node, for at most the budget plus Serve's proxy draining
  period;
- under the vllm-server layout no proxy is in the path: a stopping replica's
  vLLM server answers 503 on /health, its pod's readiness probe fails and
  the serve Service (the load balancer) drops it, within the same bound;
- the pod's `terminationGracePeriodSeconds` covers the preStop hook plus the
  time Ray takes to stop after SIGTERM;
- after a NewCluster upgrade switches traffic, KubeRay keeps the old
  cluster for `rayClusterDeletionDelaySeconds`, long enough to finish every
  stream it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.config import StackConfig

# How often a stopping Serve replica checks whether its requests are done
# (Serve's own default).
WAIT_LOOP_SECONDS = 2.0
# Serve keeps a draining proxy at least this long (its
# RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S default), so the load balancer has
# deregistered the pod before the proxy goes; the node's replicas are
# stopped no later than this after the drain starts.
PROXY_DRAIN_SECONDS = 30
# After the preStop hook, SIGTERM: `ray start --block` stops the node's processes.
STOP_SECONDS = 30
# How often the preStop hook looks for Serve processes left on the node.
POLL_SECONDS = 5
# Serve's process titles (Ray sets them with setproctitle): a replica actor
# and the node's HTTP proxy. Written as regular expressions that do not match
# their own text, so the hook's shell and grep never find themselves.
SERVE_PROCESS_PATTERNS = ("ray::Serve[R]eplica", "ray::Proxy[A]ctor")
# Ray's drain reason for a node that is going away whether or not it is idle.
DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"
# The drain request itself may not hang the hook (the head may be going too).
DRAIN_COMMAND_SECONDS = 30


def longest_generation_seconds(cfg: StackConfig) -> int:
    """The longest request the limits allow, at the SLO's pace: first token, then max_tokens tokens."""
    slo = cfg.observability.slo
    return math.ceil(slo.ttft_p95_seconds + cfg.serving.limits.max_tokens * slo.inter_token_p95_seconds)


@dataclass(frozen=True)
class Drain:
    """The drain timings of one stack, all derived from the longest generation."""

    generation_seconds: int

    @property
    def serve_timeout_seconds(self) -> int:
        """Serve's `graceful_shutdown_timeout_s`: a stopping replica finishes what it holds."""
        return self.generation_seconds

    @property
    def prestop_seconds(self) -> int:
        """The preStop hook's bound: Serve stops the node's replicas within the proxy draining period,
        then each has the whole budget."""
        return self.generation_seconds + PROXY_DRAIN_SECONDS

    @property
    def grace_seconds(self) -> int:
        """The pod's terminationGracePeriodSeconds: the preStop hook, then Ray's own stop."""
        return self.prestop_seconds + STOP_SECONDS

    @property
    def cluster_deletion_delay_seconds(self) -> int:
        """How long the old cluster of a NewCluster upgrade outlives the switch of traffic."""
        return self.prestop_seconds


def drain(cfg: StackConfig) -> Drain:
    """The drain timings `cfg`'s limits and SLOs call for."""
    return Drain(generation_seconds=longest_generation_seconds(cfg))


# This node's Ray id, from a short-lived driver on the node's own raylet:
# `ray drain-node` without `--node-id` asks `ray.get_runtime_context()`,
# which raises in a process that never called `ray.init` (ray/scripts/scripts.py
# drain_node), so the drain never happened.
NODE_ID_COMMAND = (
    "python -c \"import ray; ray.init(address='auto', log_to_driver=False, logging_level='ERROR'); "
    'print(ray.get_runtime_context().get_node_id())"'
)


def prestop_script(
    seconds: int, proc: str = "/proc", node_drain_file: str | None = None, command_seconds: int = DRAIN_COMMAND_SECONDS
) -> str:
    """The preStop hook: drain the pod's servers and this Ray node, then wait (at most `seconds`) until Serve left.

    `node_drain_file` (vllm-server pods): created first, so every vLLM server
    of the pod answers 503 on /health and closes each connection after its
    answer, whatever Ray does next. A NewCluster upgrade deletes the old
    cluster's head with its workers, so Ray's own drain may find no GCS.
    The Ray drain is best effort (`drain-node` is not a stable interface):
    if it fails, the hook still holds the pod for the whole budget, so the
    requests on it can finish. `$SECONDS` counts from the hook's start, so
    the drain request's own time is inside the bound. `proc` is where the
    processes are listed (a test, or the twin, passes its own);
    `command_seconds` bounds each of the two Ray commands (the twin's whole
    hook is shorter than one of them).
    """
    patterns = " ".join(f"-e '{p}'" for p in SERVE_PROCESS_PATTERNS)
    first = f'touch "{node_drain_file}"; ' if node_drain_file else ""
    return (
        f"{first}node_id=$(timeout {command_seconds} {NODE_ID_COMMAND} 2>/dev/null | tail -n 1); "
        f'[ -n "$node_id" ] && timeout {command_seconds} ray drain-node --node-id "$node_id" '
        f"--reason {DRAIN_REASON} --reason-message 'pod terminating' "
        f"--deadline-remaining-seconds {seconds} || true; "
        f'while [ "$SECONDS" -lt {seconds} ] && grep -qsa {patterns} {proc}/[0-9]*/cmdline; '
        f"do sleep {POLL_SECONDS}; done"
    )


def prestop_hook(seconds: int, node_drain_file: str | None = None) -> dict[str, object]:
    """The container `lifecycle` that runs `prestop_script` before SIGTERM."""
    return {
        "preStop": {"exec": {"command": ["/bin/bash", "-c", prestop_script(seconds, node_drain_file=node_drain_file)]}}
    }
