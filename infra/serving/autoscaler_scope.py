"""Holds each RayCluster's autoscaler to its own RayCluster and pods.

KubeRay 1.7 makes the autoscaler's Role itself, one per RayCluster, named
after it (common/rbac.go BuildRole: pods get/list/watch/patch, pods/resize
patch, rayclusters get/patch, no resourceNames), binds it to the head's
service account (the RayCluster's name, as no head template here names
one) and only ever creates it (raycluster_controller.go
reconcileAutoscalerRole), under a name only known once a RayService has
made the cluster. So the Role can not be narrowed from here, and as it
stands one cluster's autoscaler may patch every RayCluster and Ray pod of
the namespace. A ValidatingAdmissionPolicy closes that: a service account
of the serving namespace may update a RayCluster only if the cluster bears
its own name, and a pod only if the pod belonged to that cluster
(`ray.io/cluster` before the change, so a patch can not relabel its way in).
Nothing else of ours in that namespace updates either: the KubeRay operator
runs in its own namespace and the kubelet writes pods/status, which is not
matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.serving import kuberay
from infra.serving.namespace import PART_OF

# The requester is a service account of the object's own namespace.
SERVICE_ACCOUNT_OF_NAMESPACE = (
    "request.userInfo.username.startsWith('system:serviceaccount:' + request.namespace + ':')"
)


def _own(name_expression: str) -> str:
    return f"request.userInfo.username == 'system:serviceaccount:' + request.namespace + ':' + {name_expression}"


# A RayCluster: its own name. A pod: the cluster it belonged to before the change.
OWN_RAYCLUSTER = _own("request.name")
_OLD_LABELS = "oldObject.metadata.labels"
OWN_POD = _own(
    f"(has({_OLD_LABELS}) && '{kuberay.CLUSTER}' in {_OLD_LABELS} ? {_OLD_LABELS}['{kuberay.CLUSTER}'] : '')"
)


def policy_name(namespace: str) -> str:
    """The policy's (cluster-scoped) name, per serving namespace."""
    return f"{namespace}-ray-autoscaler-own-cluster"


def policy_spec() -> dict[str, Any]:
    """The ValidatingAdmissionPolicy: which updates it sees, and the rule for a namespace's service accounts."""
    return {
        "failurePolicy": "Fail",
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": ["ray.io"],
                    "apiVersions": ["*"],
                    "operations": ["UPDATE"],
                    "resources": ["rayclusters"],
                },
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "operations": ["UPDATE"],
                    "resources": ["pods", "pods/resize"],
                },
            ]
        },
        "matchConditions": [{"name": "service-account-of-the-namespace", "expression": SERVICE_ACCOUNT_OF_NAMESPACE}],
        "validations": [
            {
                "expression": f"request.resource.resource != 'rayclusters' || {OWN_RAYCLUSTER}",
                "message": "a RayCluster's autoscaler may change only its own RayCluster",
                "reason": "Forbidden",
            },
            {
                "expression": f"request.resource.resource != 'pods' || {OWN_POD}",
                "message": "a RayCluster's autoscaler may change only its own cluster's pods",
                "reason": "Forbidden",
            },
        ],
    }


def binding_spec(namespace: str) -> dict[str, Any]:
    """The binding: deny, in the serving namespace only."""
    return {
        "policyName": policy_name(namespace),
        "validationActions": ["Deny"],
        "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}},
    }


@dataclass(frozen=True)
class AutoscalerScopeArgs:
    """The serving namespace whose RayClusters are held apart."""

    namespace: str


class RayAutoscalerScope(pulumi.ComponentResource):
    """The admission policy and binding that keep each autoscaler to its own RayCluster (see the module)."""

    def __init__(self, name: str, args: AutoscalerScopeArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:RayAutoscalerScope", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        metadata = k8s.meta.v1.ObjectMetaArgs(name=policy_name(args.namespace), labels=dict(PART_OF))
        # The specs are plain dicts (tests read them as rendered); the SDK takes them as its input dicts.
        policy_input: Any = policy_spec()
        binding_input: Any = binding_spec(args.namespace)
        policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
            f"{name}-policy", metadata=metadata, spec=policy_input, opts=child
        )
        k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
            f"{name}-binding",
            metadata=metadata,
            spec=binding_input,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[policy]),
        )
        self.register_outputs({"policy": policy_name(args.namespace)})
