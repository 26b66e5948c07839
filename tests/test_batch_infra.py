"""Queue-fed batch work as the render declares it: queue, identities, workers and their KEDA scaling.

Prod has batch on; dev has it off (and is rendered once more with it on, at
zero workers); an existing cluster gets the queue but no IAM.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from infra.aws.layer import BatchQueue
from infra.aws.queue import RESULTS_PREFIX, queue_names
from infra.config import Batch, StackConfig
from infra.render import Rendered
from infra.scheduling import system_placement
from infra.serving import kuberay
from infra.serving.batch import (
    BATCH_KEY_VOLUME,
    TRIGGER_AUTH_NAME,
    WORKER_NAME,
    in_cluster_base_url,
    request_timeout_seconds,
    scaled_object,
    worker_env,
)
from infra.serving.ports import RAY_PORTS
from infra.serving.serve_config import MOUNTS
from policy import rules
from policy.rules import Resource
from tests.harness import (
    by_type,
    doc_config,
    manifests_of,
    reference_dir,
    release,
    render_config,
    render_stack,
    stack_doc,
    waits_for,
)
from workloads.inference_server.batch_settings import WorkerSettings

NS = "llm-platform:"
ACCOUNT = "123456789012"
QUEUE = "batch-queue"  # the queue's logical name
DEV_BATCH = {
    "enabled": True,
    "model": "llama-3.1-8b-instruct",
    "min_workers": 0,
    "max_workers": 3,
    "messages_per_worker": 4,
    "visibility_timeout_seconds": 600,
    "max_receive_count": 3,
}


def _config(doc: dict[str, Any]) -> StackConfig:
    return doc_config(doc)


def _dev_batch_doc() -> dict[str, Any]:
    doc = copy.deepcopy(stack_doc("dev"))
    doc["config"][f"{NS}batch"] = dict(DEV_BATCH)
    return doc


def _existing_doc() -> dict[str, Any]:
    doc = _dev_batch_doc()
    doc["config"][f"{NS}cluster"] = {"mode": "existing", "name": "shared-gpu", "kubeconfig_context": "shared-gpu-admin"}
    doc["config"][f"{NS}image"] = {"reference": "registry.example.com/llm-serving@sha256:" + "ab" * 32}
    return doc


@cache
def _dev_batch() -> Rendered:
    return render_config(_dev_batch_doc(), "dev")


@pytest.fixture(scope="module", params=["prod", "dev-batch"])
def stack(request: pytest.FixtureRequest) -> tuple[StackConfig, Rendered]:
    if request.param == "prod":
        return _config(stack_doc("prod")), render_stack("prod")
    return _config(_dev_batch_doc()), _dev_batch()


def _one(r: Rendered, type_token: str, name: str) -> dict[str, Any]:
    found = [x for x in by_type(r, type_token) if x["name"] == name]
    assert len(found) == 1, f"expected one {type_token} named {name}, found {len(found)}"
    return found[0]


def _manifest(r: Rendered, kind: str, name: str) -> dict[str, Any]:
    found = [m for m in manifests_of(r, kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _physical(cfg: StackConfig, logical: str) -> str:
    # The queues' physical names come from the cluster name (infra/aws/queue.py).
    return dict(zip((QUEUE, f"{QUEUE}-dlq"), queue_names(cfg.cluster.name), strict=True))[logical]


def _queue_arn(cfg: StackConfig, logical: str) -> str:
    return f"arn:aws:sqs:{cfg.region}:{ACCOUNT}:{_physical(cfg, logical)}"


def _queue_url(cfg: StackConfig, logical: str) -> str:
    """The queue's id: SQS identifies a queue by its URL."""
    return f"https://sqs.{cfg.region}.amazonaws.com/{ACCOUNT}/{_physical(cfg, logical)}"


def _list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value)


# --- AWS ---------------------------------------------------------------------------------------


def test_queue_has_sse_its_visibility_timeout_and_a_redrive_to_the_dead_letter_queue(
    stack: tuple[StackConfig, Rendered],
) -> None:
    cfg, r = stack
    name, dlq_name = queue_names(cfg.cluster.name)
    queue = _one(r, "aws:sqs/queue:Queue", QUEUE)["inputs"]
    dlq = _one(r, "aws:sqs/queue:Queue", f"{QUEUE}-dlq")["inputs"]
    assert (queue["name"], dlq["name"]) == (name, dlq_name)
    assert queue["sqsManagedSseEnabled"] is True and dlq["sqsManagedSseEnabled"] is True
    assert queue["visibilityTimeoutSeconds"] == cfg.batch.visibility_timeout_seconds
    # Failed requests outlive the requests themselves, so a person can look at them.
    assert dlq["messageRetentionSeconds"] > queue["messageRetentionSeconds"]
    assert queue["receiveWaitTimeSeconds"] == 20
    assert json.loads(queue["redrivePolicy"]) == {
        "deadLetterTargetArn": _queue_arn(cfg, f"{QUEUE}-dlq"),
        "maxReceiveCount": cfg.batch.max_receive_count,
    }
    allow = _one(r, "aws:sqs/redriveAllowPolicy:RedriveAllowPolicy", f"{QUEUE}-dlq")["inputs"]
    assert allow["queueUrl"] == _queue_url(cfg, f"{QUEUE}-dlq")
    assert json.loads(allow["redriveAllowPolicy"]) == {
        "redrivePermission": "byQueue",
        "sourceQueueArns": [_queue_arn(cfg, QUEUE)],
    }
    for logical in (QUEUE, f"{QUEUE}-dlq"):
        policy = _one(r, "aws:sqs/queuePolicy:QueuePolicy", logical)["inputs"]
        assert policy["queueUrl"] == _queue_url(cfg, logical)
        (deny,) = json.loads(policy["policy"])["Statement"]
        assert deny["Effect"] == "Deny" and deny["Resource"] == _queue_arn(cfg, logical)
        assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_results_bucket_is_private_encrypted_tls_only_expiring_and_kept(stack: tuple[StackConfig, Rendered]) -> None:
    _, r = stack
    name = f"{QUEUE}-results"
    bucket = _one(r, "aws:s3/bucket:Bucket", name)
    assert bucket["protect"] is True and bucket["inputs"]["forceDestroy"] is False
    block = _one(r, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", name)["inputs"]
    assert all(block[f] for f in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"))
    sse = _one(r, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", name)[
        "inputs"
    ]
    assert sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
    (rule,) = _one(r, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration", name)["inputs"]["rules"]
    assert rule["status"] == "Enabled" and rule["filter"] == {"prefix": RESULTS_PREFIX}
    assert rule["expiration"]["days"] >= 1
    policy = json.loads(_one(r, "aws:s3/bucketPolicy:BucketPolicy", name)["inputs"]["policy"])
    assert policy["Statement"][0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_batch_roles_name_only_the_queue_and_the_results_prefix(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    docs = {p["name"]: json.loads(p["inputs"]["policy"]) for p in by_type(r, "aws:iam/rolePolicy:RolePolicy")}
    worker, keda = docs["pod-identities-batch-worker"], docs["pod-identities-keda-operator"]
    for doc in (worker, keda):
        for stmt in doc["Statement"]:
            assert stmt["Effect"] == "Allow"
            assert not [res for res in _list(stmt["Resource"]) if "*" in res.removesuffix("/results/*")], stmt
    queue_arn = _queue_arn(cfg, QUEUE)
    by_sid = {s["Sid"]: s for s in worker["Statement"]}
    assert set(by_sid) == {"ConsumeBatchRequests", "WriteBatchResults"}
    assert by_sid["ConsumeBatchRequests"]["Resource"] == [queue_arn]
    assert sorted(by_sid["ConsumeBatchRequests"]["Action"]) == [
        "sqs:ChangeMessageVisibility",
        "sqs:DeleteMessage",
        "sqs:GetQueueAttributes",
        "sqs:ReceiveMessage",
    ]
    assert by_sid["WriteBatchResults"] == {
        "Sid": "WriteBatchResults",
        "Effect": "Allow",
        "Action": ["s3:PutObject"],
        "Resource": [f"arn:aws:s3:::{QUEUE}-results/{RESULTS_PREFIX}*"],
    }
    (read,) = keda["Statement"]
    # KEDA reads the request queue's backlog and the dead-letter queue's depth.
    assert (read["Action"], read["Resource"]) == (
        ["sqs:GetQueueAttributes"],
        [queue_arn, _queue_arn(cfg, f"{QUEUE}-dlq")],
    )


def test_keda_release_runs_as_the_account_its_pod_identity_binds(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    assoc = _one(r, "aws:eks/podIdentityAssociation:PodIdentityAssociation", "pod-identities-keda-operator")["inputs"]
    keda = release(r, "keda")
    assert keda["namespace"] == assoc["namespace"]
    assert keda["values"]["serviceAccount"]["operator"] == {"create": True, "name": assoc["serviceAccount"]}
    worker = _one(r, "aws:eks/podIdentityAssociation:PodIdentityAssociation", "pod-identities-batch-worker")["inputs"]
    deployment = _manifest(r, "Deployment", WORKER_NAME)
    assert (worker["namespace"], worker["serviceAccount"]) == (
        deployment["metadata"]["namespace"],
        deployment["spec"]["template"]["spec"]["serviceAccountName"],
    )
    assert _manifest(r, "ServiceAccount", worker["serviceAccount"])["metadata"]["namespace"] == cfg.serving.namespace


# --- serving -----------------------------------------------------------------------------------


def test_scaled_object_sizes_the_worker_deployment_to_the_queue(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    so = _manifest(r, "ScaledObject", WORKER_NAME)["spec"]
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": WORKER_NAME}
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (cfg.batch.min_workers, cfg.batch.max_workers)
    trigger, dead_letters = so["triggers"]
    # The dead-letter queue's depth is reported (for the alert), never scaled on.
    assert dead_letters["type"] == "aws-sqs-queue"
    assert dead_letters["metadata"]["queueURL"] == _queue_url(cfg, f"{QUEUE}-dlq")
    assert int(dead_letters["metadata"]["activationQueueLength"]) >= 10**9
    assert int(dead_letters["metadata"]["queueLength"]) >= 10**9
    assert dead_letters["metadata"]["scaleOnInFlight"] == "false"
    assert trigger["type"] == "aws-sqs-queue"
    assert trigger["authenticationRef"] == {"name": TRIGGER_AUTH_NAME}
    meta = trigger["metadata"]
    # The queue resource's id (its URL), not a URL typed again.
    assert meta["queueURL"] == _queue_url(cfg, QUEUE)
    assert meta["awsRegion"] == cfg.region
    assert meta["queueLength"] == str(cfg.batch.messages_per_worker)
    assert meta["activationQueueLength"] == "0"
    assert meta["scaleOnInFlight"] == "true"
    hpa = so["advanced"]["horizontalPodAutoscalerConfig"]
    assert hpa["name"] == WORKER_NAME
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
    assert so["fallback"]["replicas"] == max(cfg.batch.min_workers, 1)
    auth = _manifest(r, "TriggerAuthentication", TRIGGER_AUTH_NAME)
    assert auth["metadata"]["namespace"] == cfg.serving.namespace
    assert auth["spec"] == {"podIdentity": {"provider": "aws", "identityOwner": "keda"}}
    deployment = _manifest(r, "Deployment", WORKER_NAME)
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["BATCH_QUEUE_URL"] == meta["queueURL"]


def test_keda_objects_wait_for_the_keda_release_and_the_deployment(stack: tuple[StackConfig, Rendered]) -> None:
    _, r = stack
    keda_release = next(h for h in by_type(r, "kubernetes:helm.sh/v3:Release") if h["inputs"]["chart"] == "keda")
    so = _one(r, "kubernetes:keda.sh/v1alpha1:ScaledObject", "batch-workers-scaled-object")
    auth = _one(r, "kubernetes:keda.sh/v1alpha1:TriggerAuthentication", "batch-workers-trigger-auth")
    assert keda_release["name"] in waits_for(r.resources, so) and keda_release["name"] in waits_for(r.resources, auth)
    assert {"batch-workers-deployment", "batch-workers-trigger-auth"} <= set(so["depends_on"])


def test_workers_run_the_serving_image_on_system_nodes_locked_down(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    deployment = _manifest(r, "Deployment", WORKER_NAME)
    pod = deployment["spec"]["template"]["spec"]
    system = system_placement(cfg)
    assert pod["nodeSelector"] == system.node_selector()
    assert pod.get("tolerations", []) == system.tolerations()
    (container,) = pod["containers"]
    ray_service = manifests_of(r, "RayService")[0]
    head = ray_service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert container["image"] == head["image"] and "@sha256:" in container["image"]
    assert not [k for k in {**container["resources"]["requests"], **container["resources"]["limits"]} if "gpu" in k]
    assert container["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The worker never calls the Kubernetes API; EKS Pod Identity brings its own token.
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # Its own key (id batch-worker) in its own Secret: never the clients' keys file.
    (keys,) = [v for v in pod["volumes"] if v["name"] == BATCH_KEY_VOLUME]
    assert keys["secret"]["secretName"] == "inference-batch-api-key"
    assert not [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "inference-api-keys"]
    assert _manifest(r, "Secret", "inference-batch-api-key")["metadata"]["namespace"] == cfg.serving.namespace
    assert _manifest(r, "Secret", "inference-batch-api-key")["stringData"] == "[secret]"
    mount = {"name": BATCH_KEY_VOLUME, "mountPath": MOUNTS.batch_api_key_dir, "readOnly": True}
    assert mount in container["volumeMounts"]
    assert MOUNTS.batch_api_key_dir != MOUNTS.api_keys_dir
    # A request ends inside its message's visibility timeout, and a stopping pod may finish it.
    env = {e["name"]: e["value"] for e in container["env"]}
    timeout = float(env["BATCH_REQUEST_TIMEOUT_SECONDS"])
    assert timeout < cfg.batch.visibility_timeout_seconds
    assert pod["terminationGracePeriodSeconds"] > timeout
    assert deployment["spec"]["replicas"] == cfg.batch.min_workers


def test_worker_env_is_what_the_worker_parses_and_targets_the_batch_models_service(
    stack: tuple[StackConfig, Rendered],
) -> None:
    cfg, r = stack
    container = _manifest(r, "Deployment", WORKER_NAME)["spec"]["template"]["spec"]["containers"][0]
    settings = WorkerSettings.from_env({e["name"]: e["value"] for e in container["env"]})
    (model,) = [m for m in cfg.models if m.model_id == cfg.batch.model]
    service = _manifest(r, "RayService", model.service_name)["spec"]["serveService"]
    port = service["spec"]["ports"][0]["port"]
    assert (
        settings.base_url
        == f"http://{kuberay.serve_service_name(model.service_name)}.{cfg.serving.namespace}.svc:{port}/v1"
    )
    # Plain HTTP on the pods' own serve port (what the Service targets), never on the HTTPS port.
    assert port == RAY_PORTS.public(cfg.layout_of(model.service_name)).number != 443
    assert settings.model == cfg.batch.model
    assert settings.api_keys_file == MOUNTS.batch_api_key_file
    assert settings.results_bucket == f"{QUEUE}-results"  # the bucket resource's name (mocked)
    assert settings.results_prefix == RESULTS_PREFIX
    assert settings.region == cfg.region
    assert settings.concurrency == cfg.batch.messages_per_worker


def test_nothing_reaches_the_workers_and_they_reach_only_their_serve_port_and_aws(
    stack: tuple[StackConfig, Rendered],
) -> None:
    cfg, r = stack
    policy = _manifest(r, "NetworkPolicy", WORKER_NAME)["spec"]
    labels = _manifest(r, "Deployment", WORKER_NAME)["spec"]["template"]["metadata"]["labels"]
    (model,) = [m for m in cfg.models if m.model_id == cfg.batch.model]
    assert policy["podSelector"] == {"matchLabels": labels}
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["ingress"] == []
    serve, aws, agent = policy["egress"]
    # The port their model's serve Service targets (Serve's proxy, or under vllm-server the
    # replicas' own vLLM servers) on the pods KubeRay's serve Services select (see
    # test_security_network for why the selector is the Service's own label).
    port = RAY_PORTS.public(cfg.layout_of(model.service_name)).number
    assert port == (8100 if cfg.layout_of(model.service_name) == "vllm-server" else 8000)
    assert serve == {
        "to": [{"podSelector": {"matchLabels": {kuberay.SERVE: "true"}}}],
        "ports": [{"protocol": "TCP", "port": port}],
    }
    # SQS and S3 over HTTPS outside the VPC, and the pod identity agent for credentials.
    assert aws == {
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [str(cfg.network.vpc_cidr)]}}],
        "ports": [{"protocol": "TCP", "port": 443}],
    }
    assert agent["to"] == [{"ipBlock": {"cidr": "169.254.170.23/32"}}]
    # The model's workers admit the batch workers on the serve port.
    serve_policy = _manifest(r, "NetworkPolicy", f"{model.service_name}-ray-serve")["spec"]
    (rule,) = serve_policy["ingress"]
    assert {"podSelector": {"matchLabels": labels}} in rule["from"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]


def test_the_render_with_batch_passes_every_policy_rule(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    resources = [
        Resource(
            type=x["type"],
            name=x["name"],
            props=x["inputs"],
            protect=x["protect"],
            ref=x["name"],
            depends_on=tuple(x["depends_on"]),
        )
        for x in r.resources
    ]
    config = json.loads((Path(__file__).resolve().parent.parent / "policy" / "config" / "dev.json").read_text())
    if cfg.is_prod:
        config = json.loads((Path(__file__).resolve().parent.parent / "policy" / "config" / "prod.json").read_text())
    assert rules.evaluate(resources, config) == []


# --- CRDs --------------------------------------------------------------------------------------


def _crd_schema(plural: str) -> dict[str, Any]:
    path = reference_dir() / "keda" / f"crd-{plural}.yaml"
    crd: dict[str, Any] = yaml.safe_load(path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


# Only the ScaledObject CRD is pinned in the reference data; the
# TriggerAuthentication's shape is asserted field by field above.
@pytest.mark.parametrize(("kind", "plural"), [("ScaledObject", "scaledobjects")])
def test_keda_objects_match_the_pinned_crd(stack: tuple[StackConfig, Rendered], kind: str, plural: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = _crd_schema(plural)
    _, r = stack
    objects = [m for m in manifests_of(r, kind) if m["metadata"]["name"] in (WORKER_NAME, TRIGGER_AUTH_NAME)]
    assert objects
    for obj in objects:
        jsonschema.Draft7Validator(schema).validate(obj)


# --- off and elsewhere -------------------------------------------------------------------------


def test_dev_without_batch_has_no_queue_roles_or_workers() -> None:
    r = render_stack("dev")
    # Karpenter's interruption queue is the one queue dev has without batch.
    queues = [x for x in r.resources if x["type"].startswith("aws:sqs")]
    assert {x["parent"] for x in queues} <= {"karpenter"}
    assert not [x for x in r.resources if "batch" in x["name"] or "keda-operator" in x["name"]]
    assert not [m for m in r.manifests if m["metadata"]["name"] in (WORKER_NAME, TRIGGER_AUTH_NAME)]
    # KEDA still runs under the account the AWS layer names (a role is bound only with batch on).
    assert release(r, "keda")["values"]["serviceAccount"]["operator"]["name"] == "keda-operator"


def test_existing_cluster_gets_the_queue_and_workers_but_no_iam() -> None:
    r = render_config(_existing_doc(), "dev")
    assert _one(r, "aws:sqs/queue:Queue", QUEUE)["inputs"]["name"] == "shared-gpu-batch"
    assert not [x for x in r.resources if x["type"].startswith(("aws:iam", "aws:eks"))]
    deployment = _manifest(r, "Deployment", WORKER_NAME)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "batch-worker"
    assert _manifest(r, "ScaledObject", WORKER_NAME)["spec"]["minReplicaCount"] == 0


def test_trigger_takes_the_layers_queue_url_object() -> None:
    # Plain sentinels stand in for the layer's outputs: an Output made outside a
    # mocked program would tie the event loop the later renders use.
    url: Any = object()
    queue = BatchQueue(
        url=url,
        arn=cast(Any, "arn"),
        dead_letter_url=cast(Any, "dlq"),
        dead_letter_arn=cast(Any, "dlq-arn"),
        results_bucket=cast(Any, "results"),
        results_bucket_arn=cast(Any, "arn:aws:s3:::results"),
        results_prefix=RESULTS_PREFIX,
        region="us-east-1",
        visibility_timeout_seconds=900,
    )
    settings = Batch(enabled=True, model="m", messages_per_worker=5, visibility_timeout_seconds=900)
    so = scaled_object(settings, queue, "llm")
    assert so["spec"]["triggers"][0]["metadata"]["queueURL"] is url
    env = {e["name"]: e["value"] for e in worker_env(settings, queue, "http://svc.llm.svc:8000/v1")}
    assert env["BATCH_QUEUE_URL"] is url
    assert env["BATCH_REQUEST_TIMEOUT_SECONDS"] == str(request_timeout_seconds(settings)) == "870"


def test_an_in_cluster_url_is_never_plain_http_on_the_https_port() -> None:
    service = {"metadata": {"name": "m-serve-svc", "namespace": "llm"}, "spec": {"ports": [{"port": 8100}]}}
    assert in_cluster_base_url(service) == "http://m-serve-svc.llm.svc:8100/v1"
    service["spec"]["ports"][0]["port"] = 443
    with pytest.raises(ValueError, match="m-serve-svc has port 443"):
        in_cluster_base_url(service)
