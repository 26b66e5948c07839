"""The local run's steps (clusters, nodes, model load, ready) on the twin's own parts; see :mod:`twin.local`."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

from localserve.processes import free_port
from localserve.server import KV_CACHE_BYTES
from twin import live
from twin.checks import model_groups_for, run_static_checks
from twin.cluster import LOOPBACK, REPO
from twin.deploy import Fitting, ModelInfo
from twin.front_door import FrontDoor, Routes, Target
from twin.local_announcement import Metrics, ServedModel, announcement, served_models
from twin.render import RayServiceSpec, model_names
from twin.report import Report
from twin.routing import RouterSpec, router_specs
from twin.run import Session, prepare, start_and_deploy, wait_running, woken_front, woken_models
from twin.wake import WokenFront

# A model directory other than the tiny model: a longer context and a KV cache to hold it.
MODEL_DIR_MAX_LEN = 2048
MODEL_DIR_KV_CACHE_BYTES = 512 * 2**20
# The first request loads the engine on a new worker node.
LOAD_TIMEOUT_S = 600.0
# A replica's server is healthy once its application is RUNNING; the front door sees it within a refresh or two.
ROUTE_TIMEOUT_S = 60.0
# Where to look for a free port to suggest when the one asked for is taken.
SUGGEST_PORTS = 100


def bind_error(port: int) -> OSError | None:
    """Why 127.0.0.1:``port`` can not be listened on now (None when it can).

    Binds without SO_REUSEPORT: Serve's proxies set it, so another cluster of
    this user on the same port would otherwise share it and take half the requests.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError as err:
            return err
    return None


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (and this user may listen there)."""
    return bind_error(port) is None


def free_port_after(port: int) -> int | None:
    """The first port above ``port`` that is free now, to suggest instead of a taken one."""
    return next((p for p in range(port + 1, min(port + SUGGEST_PORTS, 65536)) if port_is_free(p)), None)


def needs_front_door(models: list[ServedModel]) -> bool:
    """Whether one Serve proxy can not be the stack's base URL: several RayServices, or vLLM's own servers."""
    return len({m.service for m in models}) > 1 or any(m.layout == "vllm-server" for m in models)


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
    """The RayServices of a stack on this machine, each its own local cluster, at one base URL until stopped.

    One RayService in the serve-ingress layout is reached at its Serve proxy
    on the port. Otherwise (several RayServices, or replicas that each run
    their own vLLM server on a free port) the front door takes the port and
    sends each request to the model it names. Every RayService serves with
    the same key, generated for this run.
    """

    def __init__(
        self,
        services: list[RayServiceSpec],
        report: Report,
        *,
        stack: str,
        model_dir: Path,
        port: int,
        left_out: list[str] | None = None,
    ) -> None:
        self.services = services
        self.report = report
        self.stack = stack
        self.model_dir = model_dir
        self.port = port
        self.left_out = list(left_out or [])
        self.models = [m for s in services for m in served_models(s.name, s.serve_config())]
        self.api_key = "twin-" + secrets.token_hex(16)
        # Short: Ray's unix sockets live under it and must stay below 108 bytes.
        self.workdir = Path(tempfile.mkdtemp(prefix="twin-local-", dir="/tmp"))
        self.sessions: list[Session] = []
        # A model at zero replicas in the vllm-server layout: the rendered gateway and router in front of it.
        self.woken: dict[str, WokenFront] = {}
        self.front_door = FrontDoor(port=port) if needs_front_door(self.models) else None

    @property
    def base_url(self) -> str:
        """The stack's one OpenAI base URL: the front door's port as bound, or the Serve proxy's."""
        port = self.front_door.port if self.front_door is not None else self.port
        return f"http://{LOOPBACK}:{port}/v1"

    def open_door(self) -> None:
        """Takes the port for the front door, before any cluster starts (OSError when it is taken)."""
        if self.front_door is None:
            return
        self.front_door.start()
        services = ", ".join(s.name for s in self.services)
        self.report.sub(
            "local",
            f"one front door at {self.base_url} for {services}: each request goes to the Ready replicas of "
            "the model it names (deployed, each RayService has its own endpoint)",
        )

    def start(self, *, max_model_len: int | None, tiny: bool) -> bool:
        """Each RayService's checks, cluster and deploy in turn, then the first request to each model."""
        names = model_names(REPO / f"Pulumi.{self.stack}.yaml")
        routers = router_specs(REPO / f"Pulumi.{self.stack}.yaml")
        self.report.note("local", f"cluster files: {self.workdir}")
        fitting = fitting_for(self.model_dir, tiny, max_model_len)
        for index, service in enumerate(self.services):
            if index:
                _disconnect_driver()
            if not self._start_service(service, self.workdir / str(index), names, fitting, routers.get(service.name)):
                return False
        if self.front_door is not None:
            self.front_door.follow(self._routes)
        return self._load_models()

    def _start_service(
        self,
        service: RayServiceSpec,
        workdir: Path,
        names: dict[str, str],
        fitting: Fitting,
        router: RouterSpec | None,
    ) -> bool:
        static = run_static_checks(service, self.report, names)
        if static is None:
            self.report.fail(service.name, "Ray can not start this RayService as rendered: see the lines above")
            return False
        autoscaling, started = static
        session = prepare(
            service,
            self.report,
            autoscaling=autoscaling,
            head=started["headgroup"],
            model_groups=model_groups_for(service, names),
            workdir=workdir,
            model_dir=self.model_dir,
            # Behind the front door, Serve's proxy on the head takes a free port.
            http_port=self.port if self.front_door is None else free_port(),
            fitting=fitting,
            idle_timeout_s=None,
            api_key=self.api_key,
            router=router,
        )
        self.sessions.append(session)
        start_and_deploy(session, self.report)
        if not wait_running(session, self.report):
            return False
        for model in woken_models(session):
            # As in the cluster, only the gateway wakes it: its first request is held while a replica starts.
            self.woken[model.model_id] = woken_front(session, self.report, model)
        return True

    def _routes(self) -> Routes:
        """Each model's Ready targets: its replicas' servers that answer /health, or its Serve proxy."""
        routes: Routes = {}
        for session in self.sessions:
            for model in session.serve.models:
                front = self.woken.get(model.model_id)
                if front is not None:
                    routes[model.model_id] = [(f"{model.model_id} gateway", front.settings.host, front.settings.port)]
                elif model.layout == "vllm-server":
                    routes[model.model_id] = ready_servers(model)
                else:
                    proxy = (f"{session.name} serve proxy", LOOPBACK, session.cluster.head_proxy_port)
                    routes[model.model_id] = [proxy]
        return routes

    def _load_models(self) -> bool:
        for session in self.sessions:
            for model in session.serve.models:
                if not self._first_request(session, model):
                    return False
        self.report.step("local", "ready")
        return True

    def _first_request(self, session: Session, model: ModelInfo) -> bool:
        group = session.model_groups.get(model.model_id, "its worker group")
        what = f"a {group} node and its engine start" if model.min_replicas == 0 else "the first request"
        self.report.step(session.name, f"model load: {model.model_id} ({what})")
        began = time.monotonic()
        try:
            door = self.front_door
            if door is not None and not live.wait_for(lambda: door.has_target(model.model_id), ROUTE_TIMEOUT_S, 1.0):
                raise RuntimeError(f"no replica's server answered /health within {ROUTE_TIMEOUT_S:.0f}s")
            self._ask_until_awake(model.model_id, began + LOAD_TIMEOUT_S)
        except Exception as err:
            self.report.fail(session.name, f"model load: {model.model_id} did not answer at {self.base_url}: {err}")
            return False
        took = time.monotonic() - began
        self.report.step(session.name, f"model load: {model.model_id} answered at {self.base_url} after {took:.0f}s")
        return True

    def _ask_until_awake(self, model_id: str, deadline: float) -> None:
        """One chat, asked again as a client would while the gateway says the model is still starting (a 503
        `model_starting` after its hold, with the seconds to wait in Retry-After)."""
        import openai

        while True:
            try:
                live.chat_at(self.base_url, self.api_key, model_id, timeout_s=max(1.0, deadline - time.monotonic()))
                return
            except openai.APIStatusError as err:
                body = err.body if isinstance(err.body, dict) else {}
                if err.status_code != 503 or body.get("code") != "model_starting":
                    raise
                wait = float(err.response.headers.get("retry-after", "5"))
                if time.monotonic() + wait >= deadline:
                    raise
                self.report.step("local", f"model load: {model_id} still starting; asking again in {wait:.0f}s")
                time.sleep(wait)

    def metrics(self) -> list[Metrics]:
        """The metrics endpoints the running replicas published (vllm-server: each replica's own server)."""
        return [
            Metrics(url=str(r["metrics_url"]), model_id=model.model_id)
            for session in self.sessions
            for model in session.serve.models
            for r in _replicas(model)
            if r.get("metrics_url")
        ]

    def announce(self) -> None:
        """What a person needs to use the stack."""
        text = announcement(self.base_url, self.api_key, self.models, metrics=self.metrics(), left_out=self.left_out)
        print(text, flush=True)

    def stop(self) -> None:
        """Stops the front door and every cluster, and removes their files."""
        if self.front_door is not None:
            self.front_door.stop()
        for front in self.woken.values():
            front.stop()
        for session in self.sessions:
            session.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _disconnect_driver() -> None:
    """Leaves the cluster this process drives (its Serve apps keep running) to drive the next one.

    Serve keeps its client in the process and trusts it while the job id
    matches, which the next cluster's first driver repeats (01000000): drop it.
    """
    import ray
    from ray.serve import context

    context._disconnect()  # type: ignore[no-untyped-call]
    ray.shutdown()


def _replicas(model: ModelInfo) -> list[dict[str, object]]:
    if model.address_dir is None:
        return []
    return [r for r in live.replica_addresses([model.address_dir]) if r.get("model_id") == model.model_id]


def ready_servers(model: ModelInfo) -> list[Target]:
    """The model's replicas whose server answers /health: the targets the rendered readiness probe lets in."""
    found: list[Target] = []
    for replica in _replicas(model):
        root = live.server_root(str(replica.get("url", "")))
        host, _, port = root.removeprefix("http://").rpartition(":")
        if port.isdigit() and live.server_health(root):
            found.append((f"{model.model_id} replica {port}", host, int(port)))
    return found
