"""Every pinned version the program deploys: one place, no ranges.

Bumping a chart here is the whole change a reviewer needs to read: the
preview diff then shows each release's version move. Helm never upgrades
CRDs, so a chart bump that ships new CRDs also needs the CRD step in the
docs/operations.md ("Upgrading CRDs").
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
# Karpenter, the default GPU node provisioner; its chart is published to ECR
# Public as an OCI artifact. The tests hold the NodePools, EC2NodeClasses and
# the controller's IAM against the CRDs and CloudFormation of tag v1.14.1.
# At that tag the repository's Chart.yaml still reads 1.13.0: the release job
# rewrites it when it publishes, so the chart that ships those files is 1.14.1.
KARPENTER = HelmChart("karpenter", "1.14.1", "oci://public.ecr.aws/karpenter")
# The EKS-optimized AMI releases Karpenter's EC2NodeClasses pin (an alias
# with a version never drifts to a newer image on its own). For GPU instance
# types Karpenter picks the NVIDIA variant of the family. Before a bump, check
# the release exists for the cluster's Kubernetes version (the AMI release
# notes, or the SSM parameters under /aws/service/eks/optimized-ami and
# /aws/service/bottlerocket): an alias that resolves to no image launches nothing.
# al2023 v20260512: an EKS AL2023 NVIDIA release for Kubernetes 1.35 (driver
# 580); Bottlerocket v1.56.0: 1.35 variants arrived in v1.53.0, on R580.
KARPENTER_AMI_ALIASES: dict[str, str] = {
    "al2023_nvidia": "al2023@v20260512",
    "bottlerocket_nvidia": "bottlerocket@v1.56.0",
}

# Upstream sources read by the tests that no pinned chart names, by their
# reference folder: the Prometheus Operator's scrape-config generation.
# kube-prometheus-stack 88.5.3 ships operator v0.93.1, a patch release of
# the same generation; v0.93.0 is the tag of that code.
UPSTREAM_SOURCES: dict[str, str] = {"prometheus-operator": "v0.93.0"}

HELM_CHARTS: tuple[HelmChart, ...] = (
    GPU_OPERATOR,
    KUBERAY_OPERATOR,
    KUBE_PROMETHEUS_STACK,
    KEDA,
    CLUSTER_AUTOSCALER,
    AWS_LOAD_BALANCER_CONTROLLER,
    EXTERNAL_DNS,
    KARPENTER,
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
RAY_LLM_BASE_TAG = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"
# The manifest list the tag pointed to when it was last resolved: a tag can be
# pushed again, a digest can not. The image builds FROM this digest only (the
# tag beside it is for people; with `name:tag@digest` the registry is asked
# for the digest alone). `make pin-base` re-resolves the tag where the
# registry is reachable and rewrites this line, so a base change is one
# reviewed diff; nothing here or in CI resolves it on its own.
# The all-zero digest is UNRESOLVED_DIGEST: the tag has not been resolved on a
# machine that can reach Docker Hub yet. Until it is, the image builds from the
# tag and every preview says so in one warning (infra/aws/registry.py): a
# digest that names no manifest would fail every build of every stack.
UNRESOLVED_DIGEST = "sha256:" + "0" * 64
RAY_LLM_BASE_DIGEST = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
RAY_LLM_BASE_PINNED = RAY_LLM_BASE_DIGEST != UNRESOLVED_DIGEST
RAY_LLM_BASE_IMAGE = f"{RAY_LLM_BASE_TAG}@{RAY_LLM_BASE_DIGEST}" if RAY_LLM_BASE_PINNED else RAY_LLM_BASE_TAG

# The placeholder that holds warm GPU nodes before a scheduled peak
# (the serving layer's pre-scaler); it only sleeps.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10@sha256:ee6521f290b2168b6e0935a181d4cff9be1ac3f505666ef0e3c98fae8199917a"

# ElastiCache engine of the Redis that keeps the Ray GCS state (prod).
ELASTICACHE_REDIS_VERSION = "7.1"

# The request router's front (infra/serving/router_front.py): nginx built to
# run as any non-root user, from ECR Public (no Docker Hub pull limits on the
# nodes). Its config is checked with Debian's nginx 1.22 in the tests and the
# twin (scripts/system-deps.sh); it uses only directives both releases share.
# The image's stop signal is SIGQUIT, nginx's graceful stop. Named by digest
# as the serving image's base is: `make pin-base` resolves both tags and
# rewrites both digest lines; until it has run where ECR Public is
# reachable, the tag, and a preview of a stack with routing on says so.
ROUTER_FRONT_TAG = "public.ecr.aws/nginx/nginx-unprivileged:1.28.0-alpine"
ROUTER_FRONT_DIGEST = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
ROUTER_FRONT_PINNED = ROUTER_FRONT_DIGEST != UNRESOLVED_DIGEST
ROUTER_FRONT_IMAGE = f"{ROUTER_FRONT_TAG}@{ROUTER_FRONT_DIGEST}" if ROUTER_FRONT_PINNED else ROUTER_FRONT_TAG
