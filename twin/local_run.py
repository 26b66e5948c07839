"""The local run's steps (cluster, nodes, model load, ready) on the twin's own parts; see :mod:`twin.local`."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
from pathlib import Path

from localserve.server import KV_CACHE_BYTES
from twin import live
from twin.checks import model_groups_for, run_static_checks
from twin.cluster import LOOPBACK, REPO
from twin.deploy import Fitting, ModelInfo
from twin.render import RayServiceSpec, model_names
from twin.report import Report
from twin.run import Session, prepare, start_and_deploy, wait_running

# A model directory other than the tiny model: a longer context and a KV cache to hold it.
MODEL_DIR_MAX_LEN = 2048
MODEL_DIR_KV_CACHE_BYTES = 512 * 2**20
# The first request loads the engine on a new worker node.
LOAD_TIMEOUT_S = 600.0


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port``.

    Binds without SO_REUSEPORT: Serve's proxies set it, so another cluster of
    this user on the same port would otherwise share it and take half the requests.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def fitting_for(model_dir: Path, tiny: bool, max_model_len: int | None) -> Fitting:
    """The engine's fit: the tiny model's, or a longer context for a model directory; rendered delays kept."""
    if tiny:
        return (
            Fitting(downscale_delay_s=None) if max_model_len is None else Fitting(max_model_len, downscale_delay_s=None)
        )
    try:
        own = int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", MODEL_DIR_MAX_LEN))
    except (OSError, ValueError):
        own = MODEL_DIR_MAX_LEN
    length = max_model_len or min(own, MODEL_DIR_MAX_LEN)
    kv = max(MODEL_DIR_KV_CACHE_BYTES, KV_CACHE_BYTES)
    return Fitting(max_model_len=length, kv_cache_bytes=kv, downscale_delay_s=None)


class LocalRun:
    """One RayService of a stack on this machine, until stopped."""

    def __init__(self, service: RayServiceSpec, report: Report, *, stack: str, model_dir: Path, port: int) -> None:
        self.service = service
        self.report = report
        self.stack = stack
        self.model_dir = model_dir
        self.port = port
        # Short: Ray's unix sockets live under it and must stay below 108 bytes.
        self.workdir = Path(tempfile.mkdtemp(prefix="twin-local-", dir="/tmp"))
        self.session: Session | None = None

    @property
    def name(self) -> str:
        """The RayService's name."""
        return self.service.name

    def start(self, *, max_model_len: int | None, tiny: bool) -> bool:
        """Ray's checks, the cluster, the deploy, then the first request, which loads each model."""
        names = model_names(REPO / f"Pulumi.{self.stack}.yaml")
        static = run_static_checks(self.service, self.report, names)
        if static is None:
            self.report.fail(self.name, "Ray can not start this RayService as rendered: see the lines above")
            return False
        autoscaling, started = static
        self.session = prepare(
            self.service,
            self.report,
            autoscaling=autoscaling,
            head=started["headgroup"],
            model_groups=model_groups_for(self.service, names),
            workdir=self.workdir,
            model_dir=self.model_dir,
            http_port=self.port,
            fitting=fitting_for(self.model_dir, tiny, max_model_len),
            idle_timeout_s=None,
        )
        self.report.note(self.name, f"cluster files: {self.workdir}")
        start_and_deploy(self.session, self.report)
        if not wait_running(self.session, self.report):
            return False
        return self._load_models()

    def base_urls(self, model: ModelInfo) -> list[str]:
        """Where a client reaches ``model``: Serve's proxy, or in the vllm-server layout each replica's own server."""
        if model.layout != "vllm-server" or model.address_dir is None:
            return [f"http://{LOOPBACK}:{self.port}/v1"]
        return sorted(str(r["url"]) for r in live.replica_addresses([model.address_dir]) if r.get("url"))

    def _load_models(self) -> bool:
        assert self.session is not None
        for model in self.session.serve.models:
            group = self.session.model_groups.get(model.model_id, "its worker group")
            self.report.step(self.name, f"model load: {model.model_id} (a {group} node and its engine start)")
            began = time.monotonic()
            try:
                urls = self.base_urls(model)
                if not urls:
                    raise RuntimeError("no replica published its server's address")
                for url in urls:
                    live.chat_at(url, self.session.serve.api_key, model.model_id, timeout_s=LOAD_TIMEOUT_S)
            except Exception as err:
                self.report.fail(self.name, f"model load: {model.model_id} did not answer: {err}")
                return False
            self.report.step(self.name, f"model load: {model.model_id} answered after {time.monotonic() - began:.0f}s")
        self.report.step(self.name, "ready")
        return True

    def announce(self) -> None:
        """What a person needs to use it."""
        assert self.session is not None
        served = self.session.serve.models
        urls = [url for m in served for url in self.base_urls(m)]
        base = urls[0]
        models = [m.model_id for m in served]
        lines = [
            "",
            f"  OpenAI base URL: {base}",
            *(f"                   {url} (another replica's server)" for url in urls[1:]),
            f"  API key:         {self.session.serve.api_key}",
            f"  models:          {', '.join(models)}",
            "",
            f"  curl {base}/chat/completions -H 'Authorization: Bearer {self.session.serve.api_key}' \\",
            f'    -H \'Content-Type: application/json\' -d \'{{"model": "{models[0]}", '
            '"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}\'',
            "",
            "  Models at min_replicas 0 go to zero after their idle time; the next request wakes them.",
            "  Ctrl-C stops everything.",
            "",
        ]
        print("\n".join(lines), flush=True)

    def stop(self) -> None:
        """Stops the cluster and removes its files."""
        if self.session is not None:
            self.session.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
