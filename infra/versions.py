"""Every pinned version the program deploys: one place, no ranges.

Bumping a chart here is the whole change a reviewer needs to read: the
preview diff then shows each release's version move. Helm never upgrades
CRDs, so a chart bump that ships new CRDs also needs the CRD step in the
README ("Upgrading CRDs").
"""

from __future__ import annotations

from dataclasses import dataclass

KUBERNETES_VERSION = "1.35"


@dataclass(frozen=True)
class HelmChart:
    """A chart pinned to one version in one repository."""

    chart: str
    version: str
    repository: str


GPU_OPERATOR = HelmChart("gpu-operator", "v26.7.0", "https://helm.ngc.nvidia.com/nvidia")
KUBERAY_OPERATOR = HelmChart("kuberay-operator", "1.7.0", "https://ray-project.github.io/kuberay-helm/")
KUBE_PROMETHEUS_STACK = HelmChart(
    "kube-prometheus-stack", "88.5.3", "https://prometheus-community.github.io/helm-charts"
)
KEDA = HelmChart("keda", "2.20.2", "https://kedacore.github.io/charts")
# The autoscaler's minor must match the cluster's: 9.59.0 ships 1.35.0.
CLUSTER_AUTOSCALER = HelmChart("cluster-autoscaler", "9.59.0", "https://kubernetes.github.io/autoscaler")
CLUSTER_AUTOSCALER_IMAGE_TAG = "v1.35.0"
AWS_LOAD_BALANCER_CONTROLLER = HelmChart("aws-load-balancer-controller", "3.5.0", "https://aws.github.io/eks-charts")
# Chart 1.21.1 ships external-dns 0.21.0; installed only where the endpoint has a domain.
EXTERNAL_DNS = HelmChart("external-dns", "1.21.1", "https://kubernetes-sigs.github.io/external-dns/")

HELM_CHARTS: tuple[HelmChart, ...] = (
    GPU_OPERATOR,
    KUBERAY_OPERATOR,
    KUBE_PROMETHEUS_STACK,
    KEDA,
    CLUSTER_AUTOSCALER,
    AWS_LOAD_BALANCER_CONTROLLER,
    EXTERNAL_DNS,
)

# EKS managed add-ons, pinned for Kubernetes 1.35 (`aws eks describe-addon-versions`).
EKS_ADDONS: dict[str, str] = {
    "vpc-cni": "v1.21.1-eksbuild.1",
    "coredns": "v1.12.4-eksbuild.1",
    "kube-proxy": "v1.35.0-eksbuild.2",
    "eks-pod-identity-agent": "v1.3.10-eksbuild.1",
    "aws-ebs-csi-driver": "v1.53.0-eksbuild.1",
}

# The serving image: Ray Serve LLM on CUDA. The RayService's rayVersion must
# equal the Ray inside this image, and Ray 2.60's `llm` extra pins vLLM 0.29.0.
RAY_VERSION = "2.60.0"
VLLM_VERSION = "0.29.0"
RAY_LLM_BASE_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"

# The placeholder that holds warm GPU nodes before a scheduled peak
# (the serving layer's pre-scaler); it only sleeps.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10@sha256:ee6521f290b2168b6e0935a181d4cff9be1ac3f505666ef0e3c98fae8199917a"

# ElastiCache engine of the Redis that keeps the Ray GCS state (prod).
ELASTICACHE_REDIS_VERSION = "7.1"
