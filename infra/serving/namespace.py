"""The serving namespace and what every RayService in it shares.

The namespace (Pod Security `restricted`, enforced), its default-deny
NetworkPolicies, the model reader's ServiceAccount (named by the AWS layer's
pod identity, so the association and the account can not disagree), the API
keys and the GCS Redis password as Secrets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.aws.layer import PodIdentity, RedisEndpoint
from infra.cluster_services.layer import PlatformPods
from infra.config import split_api_keys
from infra.serving.pod_security import restricted_namespace_labels
from infra.serving.serve_config import MOUNTS

# The AWS load balancer controller gives every pod of this namespace behind an
# IP-target load balancer a readiness gate: a new Ray pod counts as Ready only
# once the NLB target is registered and healthy, so a rollout or scale-up never
# removes the old targets before the new ones take traffic.
READINESS_GATE_LABELS = {"elbv2.k8s.aws/pod-readiness-gate-inject": "enabled"}

REDIS_PASSWORD_KEY = "password"
PART_OF = {"app.kubernetes.io/part-of": "llm-platform"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
DNS_PORT = 53
DEFAULT_DENY = "default-deny"
ALLOW_DNS = "allow-dns"
# CoreDNS as the EKS add-on labels it.
KUBE_DNS = PlatformPods("kube-system", {"k8s-app": "kube-dns"}, (DNS_PORT,))


def policy_metadata(name: str, namespace: str) -> dict[str, Any]:
    """A NetworkPolicy's metadata in the serving namespace."""
    return {"name": name, "namespace": namespace, "labels": dict(PART_OF)}


def peer(pods: PlatformPods) -> dict[str, Any]:
    """One `from`/`to` entry naming the namespace AND the pod labels in one element, so both must match."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: pods.namespace}},
        "podSelector": {"matchLabels": dict(pods.labels)},
    }


def namespace_policies(namespace: str, dns: PlatformPods = KUBE_DNS) -> list[dict[str, Any]]:
    """Deny every pod all traffic, then let every pod resolve names."""
    return [
        {
            "metadata": policy_metadata(DEFAULT_DENY, namespace),
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
        },
        {
            "metadata": policy_metadata(ALLOW_DNS, namespace),
            "spec": {
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [peer(dns)],
                        "ports": [{"protocol": proto, "port": p} for p in dns.ports for proto in ("UDP", "TCP")],
                    }
                ],
            },
        },
    ]


def api_keys_file(keys: str) -> str:
    """The mounted file: one key per line (config takes commas or newlines)."""
    return "\n".join(split_api_keys(keys)) + "\n"


@dataclass(frozen=True)
class ServingNamespaceArgs:
    """What the shared serving objects are made from."""

    namespace: str
    model_reader: PodIdentity
    api_keys: pulumi.Output[str]
    redis: RedisEndpoint | None


class ServingNamespace(pulumi.ComponentResource):
    """Namespace, model-reader ServiceAccount, API-key and Redis Secrets."""

    namespace: str
    service_account: str
    api_keys_secret: str
    redis_secret: str | None

    def __init__(self, name: str, args: ServingNamespaceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Namespace", name, None, opts)
        if args.model_reader.namespace != args.namespace:
            raise ValueError(
                f"the model reader's pod identity is bound in namespace '{args.model_reader.namespace}', "
                f"but serving.namespace is '{args.namespace}'"
            )
        k8s_opts = pulumi.ResourceOptions(parent=self)
        self.namespace = args.namespace
        ns = k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=args.namespace,
                # Every pod declared here runs as the restricted standard asks
                # (infra/serving/pod_security.py); admission refuses any other.
                labels={**PART_OF, **restricted_namespace_labels(), **READINESS_GATE_LABELS},
            ),
            opts=k8s_opts,
        )
        in_ns = pulumi.ResourceOptions(parent=self, depends_on=[ns])
        # Before any pod: nothing in the namespace talks to anything unless a
        # policy names the flow (infra/serving/network.py).
        policies = [
            k8s.networking.v1.NetworkPolicy(
                f"{name}-{policy['metadata']['name']}", metadata=policy["metadata"], spec=policy["spec"], opts=in_ns
            )
            for policy in namespace_policies(args.namespace)
        ]

        self.service_account = args.model_reader.service_account
        sa = k8s.core.v1.ServiceAccount(
            f"{name}-model-reader",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=self.service_account, namespace=args.namespace, labels=PART_OF),
            opts=in_ns,
        )

        self.api_keys_secret = "inference-api-keys"
        # The config secret stays a secret through apply; the outputs are marked too.
        keys_file = {MOUNTS.api_keys_key: args.api_keys.apply(api_keys_file)}
        keys = self._secret(f"{name}-api-keys", self.api_keys_secret, args, keys_file, in_ns)

        # What a RayService must wait for: its pods mount these.
        self.ready: list[pulumi.Resource] = [ns, *policies, sa, keys]
        self.redis_secret = None
        if args.redis is not None:
            self.redis_secret = "ray-gcs-redis"
            self.ready.append(
                self._secret(f"{name}-redis", self.redis_secret, args, {REDIS_PASSWORD_KEY: args.redis.password}, in_ns)
            )
        self.register_outputs(
            {
                "namespace": self.namespace,
                "service_account": self.service_account,
                "api_keys_secret": self.api_keys_secret,
            }
        )

    def _secret(
        self,
        resource_name: str,
        secret_name: str,
        args: ServingNamespaceArgs,
        data: Mapping[str, pulumi.Input[str]],
        opts: pulumi.ResourceOptions,
    ) -> k8s.core.v1.Secret:
        """An Opaque Secret in the serving namespace whose outputs stay secret."""
        return k8s.core.v1.Secret(
            resource_name,
            metadata=k8s.meta.v1.ObjectMetaArgs(name=secret_name, namespace=args.namespace, labels=PART_OF),
            type="Opaque",
            string_data=dict(data),
            opts=pulumi.ResourceOptions.merge(
                opts, pulumi.ResourceOptions(additional_secret_outputs=["data", "stringData"])
            ),
        )
