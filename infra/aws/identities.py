"""IAM roles for pods through EKS Pod Identity, one role per service account."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.aws import policies
from infra.aws.layer import MANAGED_NODE_GROUPS, BatchQueue, ExternalDnsAccess, PodIdentity
from infra.config import StackConfig

KUBE_SYSTEM = "kube-system"
# The service accounts the roles are bound to. The layers that create the
# accounts (platform: Helm releases; serving: the model pods) read these
# names from the PodIdentity objects, never from here.
MODEL_READER_SA = "model-reader"
CLUSTER_AUTOSCALER_SA = "cluster-autoscaler"
LOAD_BALANCER_CONTROLLER_SA = "aws-load-balancer-controller"
# Fixed by the aws-ebs-csi-driver add-on, which creates the account itself.
EBS_CSI_SA = "ebs-csi-controller-sa"
KEDA_NAMESPACE = "keda"
KEDA_OPERATOR_SA = "keda-operator"
BATCH_WORKER_SA = "batch-worker"
EXTERNAL_DNS_NAMESPACE = "external-dns"
EXTERNAL_DNS_SA = "external-dns"
# What the EKS Pod Identity webhook adds to a pod whose service account has an
# association: the node-local agent's credentials URL and the projected
# token the agent checks. The AWS SDKs' container credential provider reads
# both; tests/e2e/test_s3_weights_e2e.py plays the agent on loopback.
POD_IDENTITY_ENV = {
    "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": (
        "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount/eks-pod-identity-token"
    ),
}


def model_reader_identity(namespace: str, role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """The model pods' identity: read the model bucket."""
    return PodIdentity(namespace=namespace, service_account=MODEL_READER_SA, role_arn=role_arn)


def cluster_autoscaler_identity(role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """cluster-autoscaler's identity."""
    return PodIdentity(namespace=KUBE_SYSTEM, service_account=CLUSTER_AUTOSCALER_SA, role_arn=role_arn)


def load_balancer_controller_identity(role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """The AWS load balancer controller's identity."""
    return PodIdentity(namespace=KUBE_SYSTEM, service_account=LOAD_BALANCER_CONTROLLER_SA, role_arn=role_arn)


def keda_operator_identity(role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """KEDA's operator: it reads the batch queue's length for the batch workers' ScaledObject."""
    return PodIdentity(namespace=KEDA_NAMESPACE, service_account=KEDA_OPERATOR_SA, role_arn=role_arn)


def batch_worker_identity(namespace: str, role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """The batch workers' identity: consume the batch queue, write results."""
    return PodIdentity(namespace=namespace, service_account=BATCH_WORKER_SA, role_arn=role_arn)


def external_dns_identity(role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """external-dns' identity: change the records of the endpoint's hosted zone."""
    return PodIdentity(namespace=EXTERNAL_DNS_NAMESPACE, service_account=EXTERNAL_DNS_SA, role_arn=role_arn)


def pod_identity_role(
    name: str,
    identity: PodIdentity,
    *,
    account: pulumi.Input[str],
    cluster_name: pulumi.Input[str],
    description: str,
    opts: pulumi.ResourceOptions,
    tags: dict[str, str] | None = None,
) -> tuple[aws.iam.Role, aws.eks.PodIdentityAssociation]:
    """A role only `identity`'s service account on this cluster can assume, and the association that binds it.

    Both are named `name`; the caller attaches the role's permissions.
    """
    trust = pulumi.Output.all(account, cluster_name).apply(
        lambda a: policies.pod_identity_trust(a[0], a[1], identity.namespace, identity.service_account)
    )
    role = aws.iam.Role(
        name,
        description=description,
        assume_role_policy=pulumi.Output.json_dumps(trust),
        tags=tags,
        opts=opts,
    )
    association = aws.eks.PodIdentityAssociation(
        name,
        cluster_name=cluster_name,
        namespace=identity.namespace,
        service_account=identity.service_account,
        role_arn=role.arn,
        opts=opts,
    )
    return role, association


def external_dns_zone(cfg: StackConfig) -> str | None:
    """The hosted zone external-dns writes the endpoint's records into, or None when it does not run.

    It runs where the endpoint has a domain and the zone is given
    (`endpoint.hosted_zone_id`), unless `platform.external_dns` is switched off.
    """
    # getattr: older configs have neither key.
    zone: str | None = getattr(cfg.endpoint, "hosted_zone_id", None)
    toggle = getattr(cfg.platform, "external_dns", None)
    if cfg.endpoint.domain is None or zone is None or (toggle is not None and not toggle.enabled):
        return None
    return zone


@dataclass(frozen=True)
class IdentitiesArgs:
    """What the policies name: the cluster, the bucket and its key, the models' prefixes."""

    cluster_name: pulumi.Output[str]
    region: str
    serving_namespace: str
    bucket_arn: pulumi.Output[str]
    bucket_key_arn: pulumi.Output[str]
    model_prefixes: Sequence[str]
    # The group the nodes' ENIs carry; the load balancer controller may open it.
    node_security_group_id: pulumi.Output[str] | None = None
    # The gp3 StorageClass' customer key, if any: the EBS CSI driver then
    # needs grants on it.
    ebs_kms_key_arn: str | None = None
    # The batch queue, when batch is on: the workers and KEDA's operator then
    # get roles scoped to it.
    batch: BatchQueue | None = None
    # The Route 53 zone of the endpoint's domain, when external-dns writes
    # its records: external-dns then gets a role that may change that zone.
    hosted_zone_id: str | None = None
    # Whether cluster-autoscaler runs (managed GPU node groups, and the
    # platform part on): only then does it get a role. A role nobody uses
    # is still one more principal that may change the Auto Scaling groups.
    cluster_autoscaler: bool = True


def uses_cluster_autoscaler(cfg: StackConfig, node_provisioner: str) -> bool:
    """cluster-autoscaler runs only on managed node groups, and only when the platform installs it.

    The same test the platform layer applies before installing it
    (infra/cluster_services/build.py).
    """
    return cfg.platform.cluster_autoscaler.enabled and node_provisioner == MANAGED_NODE_GROUPS


# (partition, region, account, cluster) -> policy document
PolicyFn = Callable[[str, str, str, str], policies.Policy]


class PodIdentities(pulumi.ComponentResource):
    """Least-privilege roles for the model reader, cluster-autoscaler (where it runs), the load balancer
    controller and the EBS CSI driver, each bound to one service account by a Pod Identity association.

    Every role's trust policy admits only its own cluster, namespace and
    service account; every permission names the ARNs it needs.
    """

    model_reader: PodIdentity
    cluster_autoscaler: PodIdentity
    load_balancer_controller: PodIdentity
    ebs_csi: PodIdentity
    keda_operator: PodIdentity
    batch_worker: PodIdentity | None
    external_dns: ExternalDnsAccess | None
    associations: list[aws.eks.PodIdentityAssociation]

    def __init__(self, name: str, args: IdentitiesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:PodIdentities", name, None, opts)
        self._args = args
        self._partition = aws.get_partition_output().partition
        self._account = aws.get_caller_identity_output().account_id
        self.associations = []
        self.model_reader = self._model_reader(name)
        self.cluster_autoscaler = cluster_autoscaler_identity()
        if args.cluster_autoscaler:
            self.cluster_autoscaler = cluster_autoscaler_identity(
                self._role(
                    f"{name}-cluster-autoscaler",
                    cluster_autoscaler_identity(),
                    "Scales this cluster's node groups",
                    inline=self._scoped(policies.cluster_autoscaler),
                )
            )
        self.load_balancer_controller = self._load_balancer_controller(name)
        self.ebs_csi = self._ebs_csi(name)
        self.keda_operator = keda_operator_identity()
        self.batch_worker = None
        if args.batch is not None:
            self._batch(name, args.batch)
        self.external_dns = None
        if args.hosted_zone_id is not None:
            self.external_dns = self._external_dns(name, args.hosted_zone_id)
        self.register_outputs(
            {
                "keda_operator_role_arn": self.keda_operator.role_arn,
                "batch_worker_role_arn": self.batch_worker.role_arn if self.batch_worker else None,
                "model_reader_role_arn": self.model_reader.role_arn,
                "cluster_autoscaler_role_arn": self.cluster_autoscaler.role_arn,
                "load_balancer_controller_role_arn": self.load_balancer_controller.role_arn,
                "ebs_csi_role_arn": self.ebs_csi.role_arn,
                "external_dns_role_arn": self.external_dns.identity.role_arn if self.external_dns else None,
            }
        )

    def _model_reader(self, name: str) -> PodIdentity:
        """The model pods: read the served models' prefixes of the model bucket."""
        args = self._args
        region = args.region
        prefixes = list(args.model_prefixes)
        return model_reader_identity(
            args.serving_namespace,
            self._role(
                f"{name}-model-reader",
                model_reader_identity(args.serving_namespace),
                "Reads model weights from the model bucket",
                inline=pulumi.Output.all(args.bucket_arn, args.bucket_key_arn).apply(
                    lambda a: policies.model_reader(a[0], prefixes, a[1], region)
                ),
            ),
        )

    def _load_balancer_controller(self, name: str) -> PodIdentity:
        """The load balancer controller: this cluster's load balancers, and the nodes' security group."""
        args = self._args
        region = args.region
        return load_balancer_controller_identity(
            self._role(
                f"{name}-load-balancer-controller",
                load_balancer_controller_identity(),
                "Manages this cluster's load balancers",
                inline=pulumi.Output.all(
                    self._partition, self._account, args.cluster_name, args.node_security_group_id
                ).apply(lambda a: policies.load_balancer_controller(a[0], region, a[1], a[2], a[3])),
            )
        )

    def _ebs_csi(self, name: str) -> PodIdentity:
        """The EBS CSI driver: AWS's managed policy, plus grants on the StorageClass' key if it has one."""
        ebs_key = self._args.ebs_kms_key_arn
        region = self._args.region
        return PodIdentity(
            namespace=KUBE_SYSTEM,
            service_account=EBS_CSI_SA,
            role_arn=self._role(
                f"{name}-ebs-csi",
                PodIdentity(namespace=KUBE_SYSTEM, service_account=EBS_CSI_SA, role_arn=None),
                "Creates and attaches this cluster's EBS volumes",
                managed=self._partition.apply(lambda p: policies.EBS_CSI_MANAGED_POLICY.format(partition=p)),
                inline=(pulumi.Output.from_input(policies.kms_grants_for_ebs(ebs_key, region)) if ebs_key else None),
            ),
        )

    def _batch(self, name: str, batch: BatchQueue) -> None:
        # KEDA's operator needs a role only to read this queue: without batch
        # it calls no AWS API, so it gets none.
        self.keda_operator = keda_operator_identity(
            self._role(
                f"{name}-keda-operator",
                keda_operator_identity(),
                "Reads the batch queues' lengths for KEDA",
                inline=pulumi.Output.all(batch.arn, batch.dead_letter_arn).apply(
                    lambda a: policies.queue_length_reader(a[0], a[1])
                ),
            )
        )
        namespace = self._args.serving_namespace
        prefix = batch.results_prefix
        self.batch_worker = batch_worker_identity(
            namespace,
            self._role(
                f"{name}-batch-worker",
                batch_worker_identity(namespace),
                "Consumes the batch queue and writes batch results",
                inline=pulumi.Output.all(batch.arn, batch.results_bucket_arn).apply(
                    lambda a: policies.batch_worker(a[0], a[1], prefix)
                ),
            ),
        )

    def _external_dns(self, name: str, hosted_zone_id: str) -> ExternalDnsAccess:
        """external-dns: the records of the one hosted zone."""
        role_arn = self._role(
            f"{name}-external-dns",
            external_dns_identity(),
            "Writes the endpoint's DNS records in its hosted zone",
            inline=self._partition.apply(lambda p: policies.external_dns(p, hosted_zone_id)),
        )
        return ExternalDnsAccess(identity=external_dns_identity(role_arn), hosted_zone_id=hosted_zone_id)

    def _scoped(self, fn: PolicyFn) -> pulumi.Output[policies.Policy]:
        region = self._args.region
        return pulumi.Output.all(self._partition, self._account, self._args.cluster_name).apply(
            lambda a: fn(a[0], region, a[1], a[2])
        )

    def _role(
        self,
        name: str,
        identity: PodIdentity,
        description: str,
        *,
        inline: pulumi.Output[policies.Policy] | None = None,
        managed: pulumi.Output[str] | None = None,
    ) -> pulumi.Output[str]:
        child = pulumi.ResourceOptions(parent=self)
        role, association = pod_identity_role(
            name,
            identity,
            account=self._account,
            cluster_name=self._args.cluster_name,
            description=f"{description} ({identity.namespace}/{identity.service_account})",
            opts=child,
        )
        if inline is not None:
            aws.iam.RolePolicy(name, role=role.id, policy=pulumi.Output.json_dumps(inline), opts=child)
        if managed is not None:
            aws.iam.RolePolicyAttachment(name, role=role.name, policy_arn=managed, opts=child)
        self.associations.append(association)
        return role.arn
