"""Ray's fake multi-node provider, with one Serve proxy port per node.

Loaded by the Ray autoscaler (v2) in the head's monitor process through the
autoscaling config's ``provider: {type: external, module: ...}``. Not the
``fake_multinode`` type name: for that name Ray merges in
``fake_multi_node/example.yaml``, which the 2.60 wheel does not ship. The class
is Ray's own :class:`FakeMultiNodeProvider`; the subclass only adds one
environment variable per node.

Why: every local node shares 127.0.0.1, and Serve's proxies bind their port
with SO_REUSEPORT, so a request to a shared port reaches whichever proxy the
kernel picks and says nothing about any one node. Ray Serve 2.60 has a knob
for proxies that share a machine: ``RAY_SERVE_WORKER_PROXY_HTTP_PORT``
overrides the HTTP port of the proxy on every node but the head (read in
``serve/_private/proxy.py`` ``apply_per_node_port_overrides``). A node's
proxy actor inherits the environment of that node's raylet, and the raylet
is started here, so each worker node gets a port of its own and
``GET 127.0.0.1:<port>/-/healthz`` is exactly KubeRay's readiness probe of
that pod (``wget localhost:8000/-/healthz`` inside it). The head's proxy keeps
the configured port. Which node has which port is written to a JSON file
named in the provider config, for the twin's checks to read.

The same way the node gets its logical ``memory``: Ray's fake provider passes
every resource but CPU, GPU and the object store as a custom resource, which
Ray refuses for ``memory``. Ray resolves a new node's resources in this
process, and takes ``RAY_OVERRIDE_RESOURCES`` from the environment first
(``_private/resource_and_label_spec.py``), so the memory goes there.

This module is imported by Ray's monitor, which has the repository on its
``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

from twin.cluster import NODES_FILE_KEY

PROXY_PORT_ENV = "RAY_SERVE_WORKER_PROXY_HTTP_PORT"
RESOURCES_ENV = "RAY_OVERRIDE_RESOURCES"


# A node's proxy binds its port only once the node is up and Serve starts the proxy, many seconds
# after the port is picked. A port the kernel hands out for `bind(0)` may be taken by then by any
# process on the machine (each Ray node and vLLM server binds several); below that range only a
# process that names the port can take it.
PORT_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    """A free port on 127.0.0.1, outside the range the kernel gives to ``bind(0)`` where it can."""
    low = _ephemeral_low()
    if low > PORT_FLOOR:
        for _ in range(100):
            port = random.randrange(PORT_FLOOR, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TwinNodeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider; each worker node's Serve proxy gets its own HTTP port."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self._nodes_file = Path(provider_config[NODES_FILE_KEY])
        self._ports: dict[str, dict[str, Any]] = {}

    def _create_node_with_resources_and_labels(
        self,
        node_config: dict[str, Any],
        tags: dict[str, str],
        count: int,
        resources: dict[str, float],
        labels: dict[str, str],
    ) -> None:
        resources = dict(resources)
        memory = resources.pop("memory", None)
        with self.lock:
            before = set(self._nodes)
            port = _free_port()
            node_env = {PROXY_PORT_ENV: str(port)}
            if memory is not None:
                node_env[RESOURCES_ENV] = json.dumps({"memory": memory})
            saved = {name: os.environ.get(name) for name in node_env}
            # Ray resolves the node's resources and spawns its processes in
            # this call, under this lock: the settings reach this node only.
            os.environ.update(node_env)
            try:
                super()._create_node_with_resources_and_labels(  # type: ignore[no-untyped-call]
                    node_config, tags, count, resources, labels
                )
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            for node_id in set(self._nodes) - before:
                node_type = self._nodes[node_id]["tags"].get(TAG_RAY_USER_NODE_TYPE, "")
                self._ports[node_id] = {"node_type": node_type, "proxy_port": port}
            self._write()

    def _write(self) -> None:
        scratch = self._nodes_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(self._ports, indent=1, sort_keys=True))
        os.replace(scratch, self._nodes_file)
