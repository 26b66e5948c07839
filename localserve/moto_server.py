"""moto's server mode on loopback: a local SQS and S3 that speak AWS's wire protocol.

The batch path's end-to-end test runs the real batch worker (boto3, unchanged)
against it: the worker finds it through ``AWS_ENDPOINT_URL``, as boto3 reads
that variable for every service. The server runs in its own session on a free
127.0.0.1 port and is ended by process id.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localserve.processes import Child, child_env, free_port

REGION = "us-east-1"
# moto accepts any credentials; these keep boto3 from looking for real ones.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


class MotoStartError(RuntimeError):
    """moto's server exited or did not answer in time; the message carries its log's tail."""


@dataclass
class MotoServer:
    endpoint: str
    child: Child

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server with boto3 (and nothing real)."""
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=CREDENTIALS["AWS_SESSION_TOKEN"],
        )

    def stop(self) -> None:
        self.child.stop(grace_s=5)


def start(work_dir: Path, timeout_s: float = 60, auth_after: int | None = None, name: str = "moto") -> MotoServer:
    """Start ``moto.server`` on 127.0.0.1 and wait until it answers.

    ``auth_after``: moto answers that many requests unsigned (the test's own
    set-up), then checks every request's SigV4 signature against its IAM
    users' keys and their policies (moto's INITIAL_NO_AUTH_ACTION_COUNT).
    """
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    extra = {} if auth_after is None else {"INITIAL_NO_AUTH_ACTION_COUNT": str(auth_after)}
    child = Child.start(name, argv, child_env(extra), work_dir / f"{name}.log")
    server = MotoServer(endpoint=f"http://127.0.0.1:{port}", child=child)
    deadline = time.monotonic() + timeout_s
    while True:
        if child.proc.poll() is not None:
            raise MotoStartError(f"moto exited with {child.proc.returncode}:\n{child.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/data.json", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            child.stop(grace_s=2)
            raise MotoStartError(f"moto not ready after {timeout_s:.0f}s:\n{child.log_tail()}")
        time.sleep(0.2)
