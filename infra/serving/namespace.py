"""The serving namespace and what every RayService in it shares.

The namespace, the model reader's ServiceAccount (named by the AWS layer's
pod identity, so the association and the account can not disagree), the API
keys and the GCS Redis password as Secrets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.aws.layer import PodIdentity, RedisEndpoint
from infra.config import split_api_keys
from infra.serving.serve_config import MOUNTS

REDIS_PASSWORD_KEY = "password"
PART_OF = {"app.kubernetes.io/part-of": "llm-platform"}


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
                labels={
                    **PART_OF,
                    # Ray pods need no privileges: hold the namespace to baseline.
                    "pod-security.kubernetes.io/enforce": "baseline",
                    "pod-security.kubernetes.io/warn": "baseline",
                },
            ),
            opts=k8s_opts,
        )
        in_ns = pulumi.ResourceOptions(parent=self, depends_on=[ns])

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
        self.ready: list[pulumi.Resource] = [ns, sa, keys]
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
