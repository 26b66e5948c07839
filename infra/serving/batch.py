"""Queue-fed batch work (DESIGN.md, "Autoscaling", layer 5).

A Deployment of batch workers on the system nodes (they wait on HTTP, not on
a GPU) takes OpenAI chat requests from the AWS layer's SQS queue, sends them
to the batch model's serve Service and writes each answer to the results
bucket. KEDA sizes the Deployment to the queue's backlog: its `aws-sqs-queue`
scaler feeds an HPA (which KEDA creates) with visible plus in-flight
messages, aiming at `messages_per_worker` per worker. The ScaledObject
targets the Deployment, never a Ray object: the Ray autoscaler then adds GPU
workers for the load the batch workers send, like for any other client.

KEDA reads the queue with its operator's own credentials (the `aws` pod
identity provider, identity owner `keda`): the AWS layer binds a role that
may only call GetQueueAttributes on this queue to the operator's account.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.aws.layer import BatchQueue, PodIdentity
from infra.config import Batch
from infra.scheduling import Placement
from infra.serving.namespace import PART_OF
from infra.serving.network import batch_worker_policy
from infra.serving.pod_security import (
    RAY_GID,
    RAY_UID,
    SERVING_IMAGE_UID_SKIP,
    checkov_skips,
    container_security_context,
    pod_security_context,
)
from infra.serving.ports import HTTPS_PORT, RAY_PORTS, Port
from infra.serving.serve_config import MOUNTS
from workloads.inference_server.batch_settings import env_names

WORKER_NAME = "batch-worker"
WORKER_CONTAINER = "worker"
BATCH_KEY_VOLUME = "batch-api-key"
TRIGGER_AUTH_NAME = "batch-queue-reader"
KEDA_API_VERSION = "keda.sh/v1alpha1"
# The worker's image user (the Ray image's `ray` user and `users` group).
RUN_AS_USER = RAY_UID
RUN_AS_GROUP = RAY_GID
# Checks that can not apply to the workers, with the reason (checkov.io/skip annotations).
CHECKOV_SKIPS = {
    "CKV_K8S_8": "listens on nothing: it long-polls SQS, and a stuck worker's messages return to the queue",
    "CKV_K8S_9": "takes no traffic: readiness gates nothing for a queue consumer",
    **SERVING_IMAGE_UID_SKIP,
}
# A request must end this long before its message's visibility timeout, so
# the answer is stored and the message deleted while this worker still holds it.
VISIBILITY_MARGIN_SECONDS = 30
# After SIGTERM: the last long poll returns, then results are written and
# messages deleted; on top of the longest request in flight.
DRAIN_MARGIN_SECONDS = 30
# How often KEDA reads the queue, and how long the backlog must stay low
# before the HPA removes workers (a queue drains in bursts; without the
# window workers flap between polls).
POLLING_INTERVAL_SECONDS = 15
SCALE_DOWN_STABILIZATION_SECONDS = 300
# Only used for the last worker (to zero, when min_workers is 0).
COOLDOWN_SECONDS = 300
# Readings that may fail (KEDA can not reach SQS) before the fallback holds workers.
FALLBACK_FAILURES = 3
# The dead-letter trigger only reports the queue's depth (KEDA's
# keda_scaler_metrics_value, which the BatchDeadLetterQueueNotEmpty alert
# reads): thresholds no queue reaches, so it never wakes a worker and never
# is the HPA's largest demand.
REPORT_ONLY_QUEUE_LENGTH = str(10**9)


def worker_labels() -> dict[str, str]:
    """The worker pods' labels (and the Deployment's selector)."""
    return {**PART_OF, "app.kubernetes.io/name": WORKER_NAME, "app.kubernetes.io/component": "batch"}


def request_timeout_seconds(settings: Batch) -> int:
    """One request's budget: inside the queue's visibility timeout."""
    return settings.visibility_timeout_seconds - VISIBILITY_MARGIN_SECONDS


def in_cluster_base_url(serve_service: dict[str, Any]) -> str:
    """The OpenAI base URL of a serve Service from inside the cluster.

    KubeRay's serve Service is a ClusterIP on the pods' own port (Serve's
    proxy, or under vllm-server each replica's vLLM server): plain HTTP
    inside the cluster, which no TLS ends. TLS is the load balancer's, on
    its own Service (infra/serving/endpoint.py). An http URL on the HTTPS
    port would be a Service that carries plain HTTP where clients and tools
    expect TLS; it is refused rather than written.
    """
    meta, port = serve_service["metadata"], serve_service["spec"]["ports"][0]["port"]
    if port == HTTPS_PORT:
        raise ValueError(
            f"serve Service {meta['name']} has port {port}: the batch workers speak plain HTTP to it, "
            "so it must be the pods' own serve port, not the HTTPS port"
        )
    return f"http://{meta['name']}.{meta['namespace']}.svc:{port}/v1"


def worker_env(settings: Batch, queue: BatchQueue, base_url: str) -> list[dict[str, Any]]:
    """The worker's settings, under the names the worker's own settings model reads."""
    env = env_names()
    values: dict[str, Any] = {
        "queue_url": queue.url,
        "region": queue.region,
        "results_bucket": queue.results_bucket,
        "results_prefix": queue.results_prefix,
        "model": settings.model,
        "base_url": base_url,
        # The worker's own key (id batch-worker), never the clients' keys file.
        "api_keys_file": MOUNTS.batch_api_key_file,
        # Each worker keeps its share of the backlog in flight at once.
        "concurrency": str(settings.messages_per_worker),
        "request_timeout_seconds": str(request_timeout_seconds(settings)),
    }
    return [{"name": env[key], "value": value} for key, value in values.items()]


def _worker_container(settings: Batch, queue: BatchQueue, image: pulumi.Input[str], base_url: str) -> dict[str, Any]:
    return {
        "name": WORKER_CONTAINER,
        "image": image,
        "command": ["python", "-m", "inference_server.batch_worker"],
        "env": [*worker_env(settings, queue, base_url), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            # It waits on HTTP; a core is far more than it uses.
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [
            {"name": BATCH_KEY_VOLUME, "mountPath": MOUNTS.batch_api_key_dir, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def worker_deployment(
    *,
    settings: Batch,
    queue: BatchQueue,
    namespace: str,
    service_account: str,
    image: pulumi.Input[str],
    system: Placement,
    api_key_secret: str,
    base_url: str,
) -> dict[str, Any]:
    """The worker Deployment: non-root, read-only root, its own API key mounted read-only."""
    labels = worker_labels()
    return {
        "metadata": {
            "name": WORKER_NAME,
            "namespace": namespace,
            "labels": labels,
            "annotations": checkov_skips(CHECKOV_SKIPS),
        },
        "spec": {
            # KEDA's HPA owns the count once it exists; this is the start.
            "replicas": settings.min_workers,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **system.pod_scheduling(),
                    # The account the pod identity association names. The
                    # worker never calls the Kubernetes API, so no token is
                    # mounted: EKS Pod Identity's webhook adds its own
                    # projected token for AWS whatever this field says.
                    "serviceAccountName": service_account,
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": request_timeout_seconds(settings) + DRAIN_MARGIN_SECONDS,
                    "securityContext": pod_security_context(RUN_AS_USER, RUN_AS_GROUP),
                    "containers": [_worker_container(settings, queue, image, base_url)],
                    "volumes": [
                        {"name": BATCH_KEY_VOLUME, "secret": {"secretName": api_key_secret, "defaultMode": 0o444}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }


def trigger_authentication(namespace: str) -> dict[str, Any]:
    """KEDA reads SQS with its operator's own pod identity."""
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "TriggerAuthentication",
        "metadata": {"name": TRIGGER_AUTH_NAME, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {"podIdentity": {"provider": "aws", "identityOwner": "keda"}},
    }


def queue_triggers(settings: Batch, queue: BatchQueue) -> list[dict[str, Any]]:
    """The request queue's backlog scales the workers; the dead-letter queue's depth is only reported."""
    return [
        {
            "type": "aws-sqs-queue",
            "authenticationRef": {"name": TRIGGER_AUTH_NAME},
            "metadata": {
                "queueURL": queue.url,
                "awsRegion": queue.region,
                "queueLength": str(settings.messages_per_worker),
                # Any waiting message wakes the first worker.
                "activationQueueLength": "0",
                # Messages being answered count as backlog, so a busy
                # worker is not removed under its own requests.
                "scaleOnInFlight": "true",
            },
        },
        {
            "type": "aws-sqs-queue",
            "authenticationRef": {"name": TRIGGER_AUTH_NAME},
            "metadata": {
                "queueURL": queue.dead_letter_url,
                "awsRegion": queue.region,
                "queueLength": REPORT_ONLY_QUEUE_LENGTH,
                "activationQueueLength": REPORT_ONLY_QUEUE_LENGTH,
                "scaleOnInFlight": "false",
            },
        },
    ]


def scaled_object(settings: Batch, queue: BatchQueue, namespace: str) -> dict[str, Any]:
    """Workers sized to the queue's backlog: ceil(messages / messages_per_worker), within the bounds."""
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": {"name": WORKER_NAME, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": WORKER_NAME},
            "minReplicaCount": settings.min_workers,
            "maxReplicaCount": settings.max_workers,
            "pollingInterval": POLLING_INTERVAL_SECONDS,
            "cooldownPeriod": COOLDOWN_SECONDS,
            # If the queue can not be read, keep at least one worker going
            # rather than scale on a missing number.
            "fallback": {"failureThreshold": FALLBACK_FAILURES, "replicas": max(settings.min_workers, 1)},
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "name": WORKER_NAME,
                    "behavior": {
                        "scaleDown": {
                            "stabilizationWindowSeconds": SCALE_DOWN_STABILIZATION_SECONDS,
                            # One worker a minute: each drains its requests on the way out.
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        },
                        "scaleUp": {
                            "stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": POLLING_INTERVAL_SECONDS}],
                        },
                    },
                }
            },
            "triggers": queue_triggers(settings, queue),
        },
    }


def network_policy(namespace: str, vpc_cidr: str, serve_port: Port = RAY_PORTS.serve) -> dict[str, Any]:
    """The workers listen on nothing; they reach their model's public port, DNS and AWS APIs."""
    return batch_worker_policy(WORKER_NAME, namespace, worker_labels(), vpc_cidr, serve_port)


@dataclass(frozen=True)
class BatchWorkersArgs:
    """The batch settings, the AWS layer's queue and identity, and where the workers run."""

    settings: Batch
    queue: BatchQueue
    identity: PodIdentity
    namespace: str
    image: pulumi.Input[str]
    system: Placement
    # The worker's own key (infra/serving/namespace.py), not the clients' keys file.
    api_key_secret: str
    # The serve Service of the RayService that serves settings.model.
    serve_service: dict[str, Any]
    # The cluster's VPC: the workers reach AWS APIs outside it only.
    vpc_cidr: str
    # The port that serve Service targets on the RayService's pods (ports.RayPorts.public).
    serve_port: Port = RAY_PORTS.serve


class BatchWorkers(pulumi.ComponentResource):
    """The worker ServiceAccount and Deployment, KEDA's TriggerAuthentication and ScaledObject, a NetworkPolicy."""

    def __init__(self, name: str, args: BatchWorkersArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:BatchWorkers", name, None, opts)
        if args.identity.namespace != args.namespace:
            raise ValueError(
                f"the batch worker's pod identity is bound in namespace '{args.identity.namespace}', "
                f"but serving.namespace is '{args.namespace}'"
            )
        k8s_opts = pulumi.ResourceOptions(parent=self)
        sa = k8s.core.v1.ServiceAccount(
            f"{name}-sa",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=args.identity.service_account, namespace=args.namespace, labels=dict(PART_OF)
            ),
            opts=k8s_opts,
        )
        dep = worker_deployment(
            settings=args.settings,
            queue=args.queue,
            namespace=args.namespace,
            service_account=args.identity.service_account,
            image=args.image,
            system=args.system,
            api_key_secret=args.api_key_secret,
            base_url=in_cluster_base_url(args.serve_service),
        )
        deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=dep["metadata"],
            spec=dep["spec"],
            opts=pulumi.ResourceOptions.merge(
                k8s_opts,
                # KEDA's HPA owns the replica count once created.
                pulumi.ResourceOptions(depends_on=[sa], ignore_changes=["spec.replicas"]),
            ),
        )
        policy = network_policy(args.namespace, args.vpc_cidr, args.serve_port)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-netpol", metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
        )
        keda_opts = pulumi.ResourceOptions(parent=self)
        auth_doc = trigger_authentication(args.namespace)
        auth = k8s.apiextensions.CustomResource(
            f"{name}-trigger-auth",
            api_version=auth_doc["apiVersion"],
            kind=auth_doc["kind"],
            metadata=auth_doc["metadata"],
            spec=auth_doc["spec"],
            opts=keda_opts,
        )
        so = scaled_object(args.settings, args.queue, args.namespace)
        k8s.apiextensions.CustomResource(
            f"{name}-scaled-object",
            api_version=so["apiVersion"],
            kind=so["kind"],
            metadata=so["metadata"],
            spec=so["spec"],
            opts=pulumi.ResourceOptions.merge(keda_opts, pulumi.ResourceOptions(depends_on=[deployment, auth])),
        )
        self.register_outputs({"deployment": WORKER_NAME, "queue_url": args.queue.url})
