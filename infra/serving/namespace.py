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
import pulumi_random as random

from infra.aws.layer import PodIdentity, RedisEndpoint
from infra.cluster_services.layer import PlatformPods
from infra.config import split_api_keys
from infra.serving.pod_security import restricted_namespace_labels
from infra.serving.serve_config import MOUNTS
from workloads.inference_server.api_keys import BATCH_WORKER_KEY_ID, ApiKey, keys_file, parse_entry

# The AWS load balancer controller gives every pod of this namespace behind an
# IP-target load balancer a readiness gate: a new Ray pod counts as Ready only
# once the NLB target is registered and healthy, so a rollout or scale-up never
# removes the old targets before the new ones take traffic.
READINESS_GATE_LABELS = {"elbv2.k8s.aws/pod-readiness-gate-inject": "enabled"}

REDIS_PASSWORD_KEY = "password"
# The batch worker's generated key: 48 letters and digits, about 285 bits.
BATCH_KEY_LENGTH = 48
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


def api_keys_file(keys: str, batch_key: str | None = None) -> str:
    """The guards' keys file: `<id>:<key>` a line, each id written out, the batch worker's own key last.

    The config takes commas or newlines, and keys without an id: theirs is
    the key's fingerprint (workloads/inference_server/api_keys.py), written
    here so the file shows every id. The config rules have refused any
    entry that does not parse.
    """
    entries = [parse_entry(text, f"key {i}") for i, text in enumerate(split_api_keys(keys), start=1)]
    if batch_key is not None:
        entries.append(ApiKey(BATCH_WORKER_KEY_ID, batch_key))
    return keys_file(entries)


def batch_api_key_file(batch_key: str) -> str:
    """The batch worker's own keys file: its one key."""
    return keys_file([ApiKey(BATCH_WORKER_KEY_ID, batch_key)])


@dataclass(frozen=True)
class ServingNamespaceArgs:
    """What the shared serving objects are made from."""

    namespace: str
    model_reader: PodIdentity
    api_keys: pulumi.Output[str]
    redis: RedisEndpoint | None
    # Batch workers run: they get a key of their own (id `batch-worker`), in a
    # Secret only they mount, which the guards' keys file lists too.
    batch_key: bool = False


class ServingNamespace(pulumi.ComponentResource):
    """Namespace, model-reader ServiceAccount, API-key and Redis Secrets."""

    namespace: str
    service_account: str
    api_keys_secret: str
    batch_api_key_secret: str | None
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

        keys = self._api_key_secrets(name, args, in_ns)

        # What a RayService must wait for: its pods mount these.
        self.ready: list[pulumi.Resource] = [ns, *policies, sa, *keys]
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
                "batch_api_key_secret": self.batch_api_key_secret,
            }
        )

    def _api_key_secrets(
        self, name: str, args: ServingNamespaceArgs, opts: pulumi.ResourceOptions
    ) -> list[pulumi.Resource]:
        """The guards' keys Secret and, with batch workers, their own key: generated, in a Secret of its own."""
        self.api_keys_secret = "inference-api-keys"
        self.batch_api_key_secret = None
        if not args.batch_key:
            # The config secret stays a secret through apply; the outputs are marked too.
            guard_file = args.api_keys.apply(api_keys_file)
            return [
                self._secret(f"{name}-api-keys", self.api_keys_secret, args, {MOUNTS.api_keys_key: guard_file}, opts)
            ]
        token = random.RandomPassword(
            f"{name}-batch-api-key-token",
            length=BATCH_KEY_LENGTH,
            special=False,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["result"]),
        )
        batch_key: pulumi.Output[str] = pulumi.Output.secret(token.result)
        self.batch_api_key_secret = "inference-batch-api-key"
        batch_file = {MOUNTS.api_keys_key: batch_key.apply(batch_api_key_file)}
        guard_file = pulumi.Output.all(args.api_keys, batch_key).apply(lambda ks: api_keys_file(ks[0], ks[1]))
        return [
            self._secret(f"{name}-api-keys", self.api_keys_secret, args, {MOUNTS.api_keys_key: guard_file}, opts),
            self._secret(f"{name}-batch-api-key", self.batch_api_key_secret, args, batch_file, opts),
        ]

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
