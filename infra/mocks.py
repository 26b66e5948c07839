"""Pulumi mocks for the offline render and the unit tests.

Every resource gets its inputs back as outputs, plus a stable id and ARN.
Remote components (pulumi-eks, awsx) and resources whose outputs the
program reads (kubeconfigs, subnet ids, image digests) get those outputs
from `TYPE_OUTPUTS`, computed from the logical name so that the same
program always renders the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pulumi

ACCOUNT_ID = "123456789012"

OutputFn = Callable[[str, dict[str, Any], str], dict[str, Any]]


def fake_digest(name: str) -> str:
    """A deterministic sha256 digest for a name."""
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def _arn(service: str, region: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT_ID}:{resource}"


def _hex(*parts: str, n: int = 8) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:n]


# --- AWS layer: outputs the program reads from AWS, pulumi-eks, awsx,
# docker-build and random resources. Every value is a function of the
# logical name and inputs, so a render is repeatable byte for byte.


def _eks_cluster(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    cluster = str(inputs.get("name") or name)
    endpoint = f"https://{_hex(cluster, n=32).upper()}.gr7.{region}.eks.amazonaws.com"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": endpoint, "certificate-authority-data": "bW9jaw=="}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": cluster}}],
        "current-context": cluster,
        "users": [
            {
                "name": cluster,
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1beta1",
                        "command": "aws",
                        "args": ["eks", "get-token", "--cluster-name", cluster, "--region", region],
                    }
                },
            }
        ],
    }
    sg = f"sg-{_hex(cluster, 'cluster-sg', n=17)}"
    return {
        "kubeconfig": kubeconfig,
        "kubeconfigJson": json.dumps(kubeconfig, sort_keys=True),
        "clusterSecurityGroupId": sg,
        "nodeSecurityGroupId": sg,
    }


def _vpc(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    zones = list(inputs.get("availabilityZoneNames") or [f"{region}a", f"{region}b"])
    return {
        "vpcId": f"vpc-{_hex(name, n=17)}",
        "privateSubnetIds": [f"subnet-{_hex(name, 'private', z, n=17)}" for z in zones],
        "publicSubnetIds": [f"subnet-{_hex(name, 'public', z, n=17)}" for z in zones],
        "isolatedSubnetIds": [],
        # An output of resources that shares its name with the input: the
        # echoed input would not deserialize as NatGateway resources.
        "natGateways": [],
    }


def _node_group(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    group = str(inputs.get("nodeGroupName") or f"{inputs.get('nodeGroupNamePrefix', name + '-')}{_hex(name)}")
    asg = f"eks-{group}-{_hex(name, 'asg', n=8)}-{_hex(name, 'asg2', n=4)}"
    return {
        "nodeGroupName": group,
        "status": "ACTIVE",
        "resources": [{"autoscalingGroups": [{"name": asg}], "remoteAccessSecurityGroupId": ""}],
    }


def _image(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    digest = fake_digest(name)
    tags = inputs.get("tags") or []
    ref = f"{str(tags[0]).rsplit(':', 1)[0]}@{digest}" if tags else digest
    return {"digest": digest, "ref": ref}


def _replication_group(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    group = str(inputs.get("replicationGroupId") or name)
    return {
        "primaryEndpointAddress": f"master.{group}.{_hex(group, n=6)}.{region}.cache.amazonaws.com",
        "readerEndpointAddress": f"replica.{group}.{_hex(group, n=6)}.{region}.cache.amazonaws.com",
    }


def _random_password(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    length = int(inputs.get("length") or 32)
    text = ""
    while len(text) < length:
        text += _hex(name, "password", str(len(text)), n=64)
    return {"result": text[:length]}


def _bucket(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    bucket = str(inputs.get("bucket") or name)
    return {"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}", "region": region}


def _repository(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    repo = str(inputs.get("name") or name)
    return {
        "registryId": ACCOUNT_ID,
        "repositoryUrl": f"{ACCOUNT_ID}.dkr.ecr.{region}.amazonaws.com/{repo}",
        "arn": _arn("ecr", region, f"repository/{repo}"),
    }


def _role(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    role = str(inputs.get("name") or f"{name}-{_hex(name, n=7)}")
    return {"name": role, "arn": f"arn:aws:iam::{ACCOUNT_ID}:role/{role}"}


def _kms_key(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    h = _hex(name, n=32)
    key_id = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    return {"keyId": key_id, "arn": _arn("kms", region, f"key/{key_id}")}


def _launch_template(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    return {"latestVersion": 1, "defaultVersion": 1}


# Outputs per type token; each returns the extra outputs for (name, inputs, region).
def _queue_url(name: str, inputs: dict[str, Any], region: str) -> str:
    return f"https://sqs.{region}.amazonaws.com/{ACCOUNT_ID}/{inputs.get('name') or name}"


def _queue(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    queue = str(inputs.get("name") or name)
    return {"url": _queue_url(name, inputs, region), "arn": _arn("sqs", region, queue)}


def _event_rule(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    rule = str(inputs.get("name") or f"{name}-{_hex(name, n=7)}")
    return {"name": rule, "arn": _arn("events", region, f"rule/{rule}")}


def _iam_policy(name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    policy = str(inputs.get("name") or f"{name}-{_hex(name, n=7)}")
    return {"name": policy, "arn": f"arn:aws:iam::{ACCOUNT_ID}:policy/{policy}"}


# Resources whose provider id is not an opaque name (an SQS queue's id is its URL).
TYPE_IDS: dict[str, Callable[[str, dict[str, Any], str], str]] = {
    "aws:sqs/queue:Queue": _queue_url,
}

TYPE_OUTPUTS: dict[str, OutputFn] = {
    "aws:sqs/queue:Queue": _queue,
    "eks:index:Cluster": _eks_cluster,
    "awsx:ec2:Vpc": _vpc,
    "aws:eks/nodeGroup:NodeGroup": _node_group,
    "docker-build:index:Image": _image,
    "aws:elasticache/replicationGroup:ReplicationGroup": _replication_group,
    "random:index/randomPassword:RandomPassword": _random_password,
    "aws:s3/bucket:Bucket": _bucket,
    "aws:ecr/repository:Repository": _repository,
    "aws:iam/role:Role": _role,
    "aws:kms/key:Key": _kms_key,
    "aws:ec2/launchTemplate:LaunchTemplate": _launch_template,
    "aws:cloudwatch/eventRule:EventRule": _event_rule,
    "aws:iam/policy:Policy": _iam_policy,
}


class PlatformMocks(pulumi.runtime.Mocks):
    """Mocks that echo inputs and fill the outputs the program reads."""

    def __init__(self, region: str = "us-east-1") -> None:
        self.region = region

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        state = dict(args.inputs)
        service = args.typ.split(":")[1].split("/")[0] if ":" in args.typ else "mock"
        state.setdefault("arn", _arn(service, self.region, args.name))
        extra = TYPE_OUTPUTS.get(args.typ)
        if extra is not None:
            state.update(extra(args.name, dict(args.inputs), self.region))
        make_id = TYPE_IDS.get(args.typ)
        return (make_id(args.name, dict(args.inputs), self.region) if make_id else f"{args.name}-id"), state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": ACCOUNT_ID, "arn": _arn("iam", "", "root"), "userId": ACCOUNT_ID}, []
        if args.token == "aws:iam/getSessionContext:getSessionContext":
            # The caller is the account root (above), not a role session: its issuer is itself.
            arn = str(args.args.get("arn", ""))
            return {"arn": arn, "issuerArn": arn, "issuerId": ACCOUNT_ID, "issuerName": "", "sessionName": ""}, []
        if args.token == "aws:index/getRegion:getRegion":
            return {"name": self.region, "region": self.region, "id": self.region}, []
        if args.token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com"}, []
        if args.token == "aws:ec2/getRouteTable:getRouteTable":
            # The route table awsx associates with a private subnet (network.py's S3 endpoint).
            subnet = str(args.args.get("subnetId", ""))
            table = f"rtb-{_hex(subnet, n=17)}"
            return {**dict(args.args), "id": table, "routeTableId": table}, []
        return dict(args.args), []
