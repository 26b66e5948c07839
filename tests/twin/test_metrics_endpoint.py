"""The stand-in operator's /metrics endpoint: its own process, the file's bytes, gone with its parent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

from twin import metrics_endpoint, observe

SCRIPT = str(Path(metrics_endpoint.__file__))


def _get(port: int) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers["Content-Type"], b""


def test_it_serves_the_file_as_last_written_and_503_before(tmp_path: Path) -> None:
    exposition = tmp_path / "metrics"
    endpoint = subprocess.Popen(
        [sys.executable, SCRIPT, str(exposition), "127.0.0.1"], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert endpoint.stdout is not None
        port = int(endpoint.stdout.readline())
        assert _get(port)[0] == 503
        exposition.write_text("up_a 1\n")
        assert _get(port) == (200, metrics_endpoint.CONTENT_TYPE, b"up_a 1\n")
        exposition.write_text("up_a 2\n")
        assert _get(port)[2] == b"up_a 2\n"
    finally:
        endpoint.kill()
        endpoint.wait()
        if endpoint.stdout is not None:
            endpoint.stdout.close()


def test_it_exits_when_the_process_that_started_it_does(tmp_path: Path) -> None:
    parent = textwrap.dedent(
        f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, {SCRIPT!r}, {str(tmp_path / "m")!r}, "127.0.0.1"],
                                 stdout=subprocess.PIPE, text=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=30, check=True)
    pid, port = (int(x) for x in done.stdout.split())
    deadline = time.monotonic() + 10 * metrics_endpoint.PARENT_POLL_S
    while observe.listening_pids(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not observe.listening_pids(port), f"the endpoint (pid {pid}) outlived its parent"
