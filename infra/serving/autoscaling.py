"""Serving autoscaling beyond the RayService: scheduled GPU headroom and disruption budgets.

The layers (DESIGN.md, "Autoscaling"):
1. requests -> Serve replicas: each model's `autoscaling` in the catalogue,
   written into serveConfigV2 (serve_config.py);
2. replicas -> Ray worker pods: KubeRay's in-tree autoscaler v2 (ray_service.py);
3. pods -> GPU nodes: cluster-autoscaler (platform layer);
4. known peaks -> warm nodes ahead of time: here. KEDA's cron scaler sizes a
   Deployment of placeholder pods that each hold a whole GPU node at a
   priority below everything else, so cluster-autoscaler adds the nodes
   before the peak and a Ray worker that needs one preempts the placeholder
   at once instead of waiting minutes for a node.

A RayService or RayCluster has no scale subresource: no HPA or ScaledObject
here (or anywhere) targets one. The Ray autoscaler owns worker counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.config import Model, PreScale
from infra.scheduling import GpuPlacement
from infra.serving import kuberay
from infra.serving.namespace import PART_OF
from infra.serving.pod_security import PAUSE_UID, checkov_skips, container_security_context, pod_security_context
from infra.serving.ray_service import INGRESS_GROUP, worker_group_name
from workloads.inference_server.catalog import Layout

SCALED_OBJECT_TYPE = "kubernetes:keda.sh/v1alpha1:ScaledObject"
HEADROOM_CLASS = "gpu-headroom"
SERVING_CLASS = "llm-serving"
# Above the default (0) so Ray GPU workers preempt placeholders and ordinary
# pods, below system-cluster-critical (2e9).
SERVING_PRIORITY = 100_000
# Negative so anything preempts the placeholders, but not below
# cluster-autoscaler's expendable cutoff (-10): pods under it never trigger
# a scale-up, and holding nodes is the placeholders' only job.
HEADROOM_PRIORITY = -5
# Checks that can not apply to a placeholder, with the reason (checkov.io/skip annotations).
HEADROOM_CHECKOV_SKIPS = {
    "CKV_K8S_8": "a pause container that only holds a GPU node; it serves nothing to probe",
    "CKV_K8S_9": "a pause container that only holds a GPU node; no traffic is sent to it",
}


def priority_classes() -> list[dict[str, Any]]:
    """The serving and headroom PriorityClasses."""
    return [
        {
            "metadata": {"name": SERVING_CLASS, "labels": dict(PART_OF)},
            "value": SERVING_PRIORITY,
            "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": "Ray GPU workers serving models: preempt GPU headroom placeholders.",
        },
        {
            "metadata": {"name": HEADROOM_CLASS, "labels": dict(PART_OF)},
            "value": HEADROOM_PRIORITY,
            "globalDefault": False,
            "preemptionPolicy": "Never",
            "description": "Placeholders holding warm GPU nodes before scheduled peaks; first to go.",
        },
    ]


def headroom_name(window: PreScale) -> str:
    """The placeholder Deployment (and its ScaledObject) of a pre-scale window."""
    return f"gpu-headroom-{window.name}"


def headroom_deployment(window: PreScale, placement: GpuPlacement, namespace: str) -> dict[str, Any]:
    """Placeholder pods, one per whole GPU node of the window's group; KEDA sets replicas."""
    name = headroom_name(window)
    labels = {**PART_OF, "app.kubernetes.io/name": name}
    gpus = {"nvidia.com/gpu": str(placement.gpus_per_node)}
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": checkov_skips(HEADROOM_CHECKOV_SKIPS),
        },
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **placement.pod_scheduling(),
                    "priorityClassName": HEADROOM_CLASS,
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security_context(PAUSE_UID, PAUSE_UID),
                    "containers": [
                        {
                            "name": "pause",
                            "image": versions.PAUSE_IMAGE,
                            "resources": {
                                "requests": {"cpu": "10m", "memory": "16Mi", **gpus},
                                "limits": {"cpu": "10m", "memory": "16Mi", **gpus},
                            },
                            "securityContext": container_security_context(read_only_root=True),
                        }
                    ],
                },
            },
        },
    }


def headroom_scaled_object(window: PreScale, namespace: str) -> dict[str, Any]:
    """KEDA cron: `nodes` placeholders during the window, none outside it."""
    name = headroom_name(window)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": 0,
            "maxReplicaCount": window.nodes,
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "cron",
                    "metadata": {
                        "timezone": window.timezone,
                        "start": window.start,
                        "end": window.end,
                        "desiredReplicas": str(window.nodes),
                    },
                }
            ],
        },
    }


def budget(min_replicas: int) -> dict[str, Any]:
    """What an eviction may take from a group that keeps `min_replicas` replicas.

    One pod at a time where another replica serves on; where the group keeps
    exactly one replica, that one must stay (`minAvailable: 1`): a drain waits
    until Serve has a second one, or an operator decides. A group that may be
    at zero protects nothing.
    """
    return {"minAvailable": 1} if min_replicas == 1 else {"maxUnavailable": 1}


def disruption_budgets(
    ray_service: str,
    models: list[Model],
    namespace: str,
    *,
    ingress_min_replicas: int = 1,
    gcs_fault_tolerant: bool = False,
    layout: Layout = "serve-ingress",
) -> list[dict[str, Any]]:
    """Budgets for a RayService's head, its ingress group (serve-ingress only) and each GPU group (see `budget`).

    The head is one pod: it must stay unless the GCS keeps its state in
    Redis, where a restarted head picks up again and the workers keep
    serving. Selected by KubeRay's labels, so the budgets cover the pods of
    the active and, during an upgrade, the pending cluster.
    """
    groups: list[tuple[str, dict[str, str], dict[str, Any]]] = [
        ("head", {kuberay.NODE_TYPE: "head"}, {"maxUnavailable": 1} if gcs_fault_tolerant else {"minAvailable": 1}),
    ]
    if layout == "serve-ingress":
        groups.append((INGRESS_GROUP, {kuberay.GROUP: INGRESS_GROUP}, budget(ingress_min_replicas)))
    groups += [
        (worker_group_name(m), {kuberay.GROUP: worker_group_name(m)}, budget(m.autoscaling.min_replicas))
        for m in models
    ]
    return [
        {
            "metadata": {"name": f"{ray_service}-{suffix}", "namespace": namespace, "labels": dict(PART_OF)},
            "spec": {**limit, "selector": {"matchLabels": {**kuberay.pods_of(ray_service), **selector}}},
        }
        for suffix, selector, limit in groups
    ]


@dataclass(frozen=True)
class ServingAutoscalingArgs:
    """Pre-scale windows, the GPU groups they warm and the RayServices to protect."""

    namespace: str
    prescale: list[PreScale]
    gpu: dict[str, GpuPlacement]
    services: dict[str, list[Model]]
    # The OpenAI ingress' minimum replicas, and whether the GCS survives a head restart.
    ingress_min_replicas: int = 1
    gcs_fault_tolerant: bool = False
    # RayService name -> its layout (serve-ingress where missing).
    layouts: dict[str, Layout] = field(default_factory=dict)


class ServingAutoscaling(pulumi.ComponentResource):
    """PriorityClasses, scheduled GPU headroom (KEDA cron) and PodDisruptionBudgets."""

    serving_priority_class: str

    def __init__(self, name: str, args: ServingAutoscalingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Autoscaling", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        classes = [
            k8s.scheduling.v1.PriorityClass(
                f"{name}-{pc['metadata']['name']}",
                metadata=pc["metadata"],
                value=pc["value"],
                global_default=pc["globalDefault"],
                preemption_policy=pc["preemptionPolicy"],
                description=pc["description"],
                opts=k8s_opts,
            )
            for pc in priority_classes()
        ]
        self.serving_priority_class = SERVING_CLASS
        self.priority_classes: list[pulumi.Resource] = list(classes)

        for window in args.prescale:
            dep = headroom_deployment(window, args.gpu[window.gpu_group], args.namespace)
            deployment = k8s.apps.v1.Deployment(
                f"{name}-{headroom_name(window)}",
                metadata=dep["metadata"],
                spec=dep["spec"],
                opts=pulumi.ResourceOptions.merge(
                    k8s_opts,
                    # KEDA's HPA owns the replica count once created.
                    pulumi.ResourceOptions(depends_on=classes, ignore_changes=["spec.replicas"]),
                ),
            )
            so = headroom_scaled_object(window, args.namespace)
            k8s.apiextensions.CustomResource(
                f"{name}-{headroom_name(window)}-cron",
                api_version=so["apiVersion"],
                kind=so["kind"],
                metadata=so["metadata"],
                spec=so["spec"],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[deployment]),
            )

        for service, models in args.services.items():
            for pdb in disruption_budgets(
                service,
                models,
                args.namespace,
                ingress_min_replicas=args.ingress_min_replicas,
                gcs_fault_tolerant=args.gcs_fault_tolerant,
                layout=args.layouts.get(service, "serve-ingress"),
            ):
                k8s.policy.v1.PodDisruptionBudget(
                    f"{name}-{pdb['metadata']['name']}", metadata=pdb["metadata"], spec=pdb["spec"], opts=k8s_opts
                )
        self.register_outputs({"serving_priority_class": self.serving_priority_class})
