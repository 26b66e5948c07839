"""The production weight path: s3:// through vLLM's runai_streamer, with the GPU pod's own environment.

The tiny model is uploaded to a local S3 API (moto's server mode) and loaded
by vLLM's offline engine with exactly the engine arguments the server builds
(engine.engine_kwargs: load_format runai_streamer, model_loader_extra_config)
and the environment the GPU worker template renders (ray_service.gpu_worker_env)
plus what EKS Pod Identity adds (identities.POD_IDENTITY_ENV). Swapped for
local stand-ins: the S3 endpoint (moto), the credentials URL (a loopback
HTTP server playing the Pod Identity agent, which checks the token file's
token) and the cache root (a temporary directory instead of the emptyDir).
No static AWS keys reach the loader. This moto does not check signatures;
the second test runs the streamer's C++ client against one that does.

Then the same model from a local directory: the outputs must be token-identical,
and both load times are printed (docs/capacity.md).

Tensor parallelism (docs/capacity.md, the cold-start budget): two ranks load
through vLLM's runai_streamer loader, once plain and once with
`distributed`, each behind its own byte-counting pass-through to moto; plain,
each rank reads the whole checkpoint, distributed they split it and both get
every tensor exactly.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from infra.aws.identities import POD_IDENTITY_ENV
from infra.config import ColdStartTimeouts
from infra.serving.ray_service import gpu_worker_env
from localserve import moto_server
from localserve.processes import Child, child_env
from tests.e2e.conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPT
from tests.e2e.loopback_http import LoopbackHttp
from tests.e2e.s3_byte_counter import ByteCounter
from tests.e2e.s3_load_main import weights_seconds
from workloads.inference_server.catalog import Catalog, ModelEntry, S3Streamer
from workloads.inference_server.engine import S3_LOAD_FORMAT, engine_kwargs, streamer_config

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
BUCKET = "llm-weights-e2e"
PREFIX = "tiny/llama"
TOKEN = "pod-identity-token-e2e"
# What the fake agent hands out; moto accepts any key.
AGENT_KEYS = {"AccessKeyId": "ASIAPODIDENTITY", "SecretAccessKey": "agent-secret", "Token": "agent-session"}
LOAD_TIMEOUT_S = 150
# Static keys, profiles or a real endpoint in the caller's environment would
# hide whether the pod identity path works.
STRIPPED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")
# CPU engine settings of the other e2e tests (a small KV cache, no compile).
CPU_ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 1024 * 1024, "seed": 0, "max_model_len": 512}
TP = 2
RANKS_TIMEOUT_S = 90
# What the CPU build needs for TP=2 where a GPU node needs nothing: vLLM's CPU
# workers form a gloo group, over which runai_streamer's "auto" mode does not
# distribute (distributed_streamer.py: `elif enable_dist == "auto" and
# backend_name != "nccl":` falls back; GPU ranks use NCCL), so it is asked
# for; and with one NUMA node vLLM will not bind two CPU workers itself ("Not
# enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so they
# run unbound.
CPU_TP_ENV = {"RUNAI_STREAMER_DIST": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class FakeAgent(LoopbackHttp):
    """The EKS Pod Identity agent on 127.0.0.1: credentials for the right token, 401 otherwise (or always)."""

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self.requests: list[str] = []
        self.keys = dict(AGENT_KEYS if keys is None else keys)
        self.refuse = False
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization", "")
                agent.requests.append(auth)
                if auth != TOKEN or agent.refuse:
                    self.send_response(401)
                    self.end_headers()
                    return
                expiry = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
                body = json.dumps({**agent.keys, "Expiration": expiry}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler)

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/credentials"


@pytest.fixture(scope="module")
def s3(tiny_model: Path, e2e_dir: Path) -> Iterator[moto_server.MotoServer]:
    server = moto_server.start(e2e_dir)
    try:
        client = server.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(tiny_model.iterdir()):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent()
    try:
        yield fake
    finally:
        fake.stop()


def pod_env(endpoint: str, agent: FakeAgent, work: Path) -> dict[str, str]:
    """The GPU pod's environment as rendered, with only the endpoint, credentials URL and cache root local."""
    token_file = work / "eks-pod-identity-token"
    token_file.write_text(TOKEN)
    rendered = {e["name"]: e["value"] for e in gpu_worker_env(moto_server.REGION, ColdStartTimeouts(), str(work))}
    identity = {
        **POD_IDENTITY_ENV,
        "AWS_CONTAINER_CREDENTIALS_FULL_URI": agent.url,
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": str(token_file),
    }
    # moto answers on an IP address: path-style requests instead of bucket.host.
    endpoint_env = {"AWS_ENDPOINT_URL": endpoint, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
    env = {k: v for k, v in child_env().items() if k not in STRIPPED}
    return {**env, **rendered, **identity, **endpoint_env}


def load(
    name: str, model: str, kwargs: dict[str, Any], env: dict[str, str], work: Path, max_tokens: int = GREEDY_MAX_TOKENS
) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(HERE / "s3_load_main.py"),
        "--model",
        model,
        "--engine-kwargs",
        json.dumps(kwargs),
        "--prompt",
        GREEDY_PROMPT,
        "--max-tokens",
        str(max_tokens),
    ]
    child = Child.start(name, argv, env, work / f"{name}.log")
    try:
        child.proc.wait(timeout=LOAD_TIMEOUT_S)
    except Exception:
        child.stop(grace_s=5)
        pytest.fail(f"{name} load did not finish in {LOAD_TIMEOUT_S} s:\n{child.log_tail()}")
    finally:
        child.stop(grace_s=5)
    assert child.proc.returncode == 0, child.log_tail()
    lines = [ln for ln in child.log_path.read_text(errors="replace").splitlines() if ln.startswith('{"text"')]
    assert lines, child.log_tail()
    result = dict(json.loads(lines[-1]))
    result["weights_seconds"] = weights_seconds(child.log_path)
    return result


def test_s3_weights_load_like_prod_and_match_a_local_load(
    tiny_model: Path, s3: moto_server.MotoServer, agent: FakeAgent, e2e_dir: Path
) -> None:
    work = e2e_dir / "s3-weights"
    work.mkdir(exist_ok=True)
    source = f"s3://{BUCKET}/{PREFIX}"
    entry = ModelEntry(
        model_id="tiny",
        source=source,
        max_model_len=512,
        dtype="float32",
        gpu_memory_utilization=0.2,
        streamer=S3Streamer(concurrency=4, memory_limit=256 * 1024 * 1024),
        engine_overrides={k: v for k, v in CPU_ENGINE.items() if k != "max_model_len"},
    )
    kwargs = engine_kwargs(entry, Catalog(models=[entry]))
    assert kwargs["load_format"] == S3_LOAD_FORMAT
    assert kwargs["model_loader_extra_config"] == {"concurrency": 4, "memory_limit": 256 * 1024 * 1024}

    started = time.monotonic()
    from_s3 = load("s3", source, kwargs, pod_env(s3.endpoint, agent, work), work)
    s3_wall = time.monotonic() - started
    # The credentials came from the pod identity path, with the token from the file.
    assert TOKEN in agent.requests, f"the fake Pod Identity agent was never asked: {agent.requests}"
    # ...and the weights really were read from S3: moto saw the safetensors GETs.
    log = (e2e_dir / "moto.log").read_text(errors="replace")
    assert "model.safetensors" in log, "moto's log shows no request for the weights"

    local_kwargs = {k: v for k, v in kwargs.items() if k not in ("load_format", "model_loader_extra_config")}
    started = time.monotonic()
    local_env = {k: v for k, v in child_env().items() if k not in STRIPPED}
    from_dir = load("local", str(tiny_model), local_kwargs, local_env, work)
    local_wall = time.monotonic() - started

    assert from_s3["token_ids"] == from_dir["token_ids"], (from_s3, from_dir)
    assert len(from_s3["token_ids"]) == GREEDY_MAX_TOKENS
    size = sum(p.stat().st_size for p in tiny_model.glob("*.safetensors"))
    print(
        f"\nweights {size / 2**20:.1f} MiB: s3 (runai_streamer) weights {from_s3['weights_seconds']} s, "
        f"engine {from_s3['engine_seconds']:.1f} s, process {s3_wall:.1f} s; "
        f"local dir weights {from_dir['weights_seconds']} s, engine {from_dir['engine_seconds']:.1f} s, "
        f"process {local_wall:.1f} s"
    )


def safetensors_header_bytes(path: Path) -> int:
    """The file's length prefix and JSON header: every rank reads them itself, distributed or not."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def fingerprints(path: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes in a safetensors file, by name (as runai_rank_main.py prints them)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        names = list(f.keys())
        return {name: hashlib.sha256(f.get_tensor(name).tobytes()).hexdigest() for name in names}


def test_ranks_streaming_distributed_read_the_checkpoint_once_between_them(
    tiny_model: Path, s3: moto_server.MotoServer, agent: FakeAgent, e2e_dir: Path
) -> None:
    """Two ranks through vLLM's loader: plain, each reads the whole checkpoint; distributed, they split it.

    No engine: each rank joins a gloo group and loads through
    RunaiModelStreamerLoader.load_weights (runai_rank_main.py), behind its
    own byte counter, so what each rank took from S3 is measured, not inferred.
    """
    work = e2e_dir / "s3-ranks"
    work.mkdir(exist_ok=True)
    weights = tiny_model / "model.safetensors"
    client = s3.client("s3")
    sources: dict[str, str] = {}
    for mode in ("plain", "distributed"):
        client.upload_file(str(weights), BUCKET, f"ranks-{mode}/model.safetensors")
        sources[mode] = f"s3://{BUCKET}/ranks-{mode}"
    streamer = S3Streamer(concurrency=4, memory_limit=64 * 1024 * 1024)
    extra = {
        mode: streamer_config(streamer.model_copy(update={"distributed": mode == "distributed"})) for mode in sources
    }
    assert extra["distributed"]["distributed"] is True and "distributed" not in extra["plain"]

    init = work / "process-group"
    init.unlink(missing_ok=True)
    counters = [ByteCounter(s3.endpoint) for _ in range(TP)]
    children: list[Child] = []
    try:
        for rank, counter in enumerate(counters):
            argv = [sys.executable, str(HERE / "runai_rank_main.py"), "--rank", str(rank), "--world-size", str(TP)]
            argv += ["--init-method", f"file://{init}"]
            for mode, source in sources.items():
                argv += ["--source", source, "--extra-config", json.dumps(extra[mode])]
            env = {**pod_env(counter.endpoint, agent, work), **CPU_TP_ENV}
            children.append(Child.start(f"rank{rank}", argv, env, work / f"rank{rank}.log"))
        results = []
        for child in children:
            try:
                child.proc.wait(timeout=RANKS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # One rank stuck is usually the other one's failure: show both.
                pytest.fail("\n".join(f"{c.log_path.name}:\n{c.log_tail()}" for c in children))
            assert child.proc.returncode == 0, child.log_tail()
            lines = [ln for ln in child.log_path.read_text(errors="replace").splitlines() if ln.startswith('{"rank"')]
            assert lines, child.log_tail()
            results.append(json.loads(lines[-1]))
    finally:
        for child in children:
            child.stop(grace_s=5)
        for counter in counters:
            counter.stop()

    expected = fingerprints(weights)
    for result in results:
        for mode, source in sources.items():
            assert result["tensors"][source] == expected, f"rank {result['rank']} loaded other tensors ({mode})"
    size, header = weights.stat().st_size, safetensors_header_bytes(weights)
    plain = [c.read_of("/ranks-plain/model.safetensors") for c in counters]
    shared = [c.read_of("/ranks-distributed/model.safetensors") for c in counters]
    # Plain: every rank reads all of it, so a node of TP ranks reads it TP times.
    assert all(n >= size for n in plain), (plain, size)
    # Distributed: together once (each reads the header itself), neither near the whole.
    assert size <= sum(shared) <= size + TP * header, (shared, size)
    assert all(0 < n < 0.75 * size for n in shared), (shared, size)
    print(f"\n{size} B checkpoint, per rank from S3: plain {plain}, distributed {shared}")


STREAM_ONE_FILE = """
import sys
from runai_model_streamer import SafetensorsStreamer
with SafetensorsStreamer() as streamer:
    streamer.stream_file(sys.argv[1])
    print("tensors", sum(1 for _ in streamer.get_tensors()))
"""


def test_the_streamers_s3_client_signs_with_the_pod_identity_credentials(tiny_model: Path, e2e_dir: Path) -> None:
    """runai_streamer's C++ client (not boto3) against an S3 that checks signatures: keys only from the agent.

    moto with auth on refuses unsigned or unknown-key requests, so a load
    that works proves the C++ client took the agent's credentials; with the
    agent refusing, the same load must fail. No vLLM: seconds, not minutes.
    """
    work = e2e_dir / "s3-signed"
    work.mkdir(exist_ok=True)
    # Five set-up requests go unsigned: the user, its key, its policy, the bucket, the object.
    server = moto_server.start(work, auth_after=5, name="moto-auth")
    fake: FakeAgent | None = None
    try:
        iam, s3 = server.client("iam"), server.client("s3")
        iam.create_user(UserName="model-reader")
        key = iam.create_access_key(UserName="model-reader")["AccessKey"]
        read = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="model-reader", PolicyName="read", PolicyDocument=json.dumps(read))
        s3.create_bucket(Bucket=BUCKET)
        s3.upload_file(str(tiny_model / "model.safetensors"), BUCKET, f"{PREFIX}/model.safetensors")
        # IAM user keys carry no session token (moto would check one against STS).
        fake = FakeAgent({"AccessKeyId": key["AccessKeyId"], "SecretAccessKey": key["SecretAccessKey"]})
        env = pod_env(server.endpoint, fake, work)
        # The streamer's C++ client only: no boto3 session in Python (0.17's default, explicit here).
        env["RUNAI_STREAMER_NO_BOTO3_SESSION"] = "1"
        argv = [sys.executable, "-c", STREAM_ONE_FILE, f"s3://{BUCKET}/{PREFIX}/model.safetensors"]
        ok = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert ok.returncode == 0 and ok.stdout.startswith("tensors "), ok.stderr[-2000:]
        assert TOKEN in fake.requests
        fake.refuse = True
        refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode != 0, "the streamer read the weights without the agent's credentials"
    finally:
        if fake is not None:
            fake.stop()
        server.stop()
