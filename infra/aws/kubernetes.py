"""The one Kubernetes provider every in-cluster resource is created with."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s


@dataclass(frozen=True)
class KubernetesAccessArgs:
    """Either the kubeconfig of the cluster made here, or a context of the user's kubeconfig."""

    kubeconfig: pulumi.Output[str] | None = None
    context: str | None = None

    def __post_init__(self) -> None:
        if (self.kubeconfig is None) == (self.context is None):
            raise ValueError("give exactly one of kubeconfig and context")


class KubernetesAccess(pulumi.ComponentResource):
    """Holds the stack's single kubernetes provider.

    For a cluster made here it is built from the cluster's kubeconfig (a
    secret: it names the API server and the token command); for an existing
    cluster from a context of the kubeconfig of whoever runs the program.
    """

    provider: k8s.Provider

    def __init__(self, name: str, args: KubernetesAccessArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:KubernetesAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        if args.kubeconfig is not None:
            self.provider = k8s.Provider(name, kubeconfig=args.kubeconfig, opts=child)
        else:
            self.provider = k8s.Provider(name, context=args.context, opts=child)
        self.register_outputs({})
