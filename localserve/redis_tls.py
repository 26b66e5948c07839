"""A TLS-only Redis with a password on 127.0.0.1, as prod's ElastiCache is configured.

Used by the GCS fault-tolerance test: Debian's `redis-server` behind a CA and
server certificate made here with the `openssl` CLI, a password in a config
file (not on the command line), and a small RESP client that checks it over
verified TLS. The server runs as a `Child` in its own session, ended by pid.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from localserve.processes import Child, child_env, free_port

HOST = "127.0.0.1"


class RedisStartError(RuntimeError):
    """redis-server exited or did not answer over TLS in time; the message carries its log's tail."""


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and a server certificate it signed (for 127.0.0.1 and localhost)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "test CA") -> tuple[Path, Path]:
    """A self-signed CA (EC P-256, two days); returns its certificate and key."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    return cert, key


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 signed by it, under `directory`."""
    ca_cert, ca_key = make_ca(directory, "llm-platform GCS test CA")
    server_key, csr, server_cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    extensions = directory / "server.ext"
    extensions.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(server_key), "-out", str(csr), "-subj", "/CN=127.0.0.1",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(server_cert), "-days", "2", "-extfile", str(extensions),
        cwd=directory,
    )  # fmt: skip
    for path in (ca_key, server_key):
        path.chmod(0o600)
    return TlsFiles(ca_cert=ca_cert, server_cert=server_cert, server_key=server_key)


def new_password() -> str:
    """Letters and digits only, like prod's generated auth token."""
    return secrets.token_hex(24)


def _encode(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RedisError(RuntimeError):
    """An error reply from Redis."""


class _Reader:
    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._file = sock.makefile("rb")

    def _line(self) -> bytes:
        line = self._file.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("connection closed by Redis")
        return line[:-2]

    def reply(self) -> object:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = self._file.read(size + 2)
            return data[:-2]
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self.reply() for _ in range(count)]
        raise RedisError(f"unexpected reply {line!r}")


def redis_command(port: int, password: str, ca_cert: Path, *args: str, timeout_s: float = 5.0) -> object:
    """AUTH then one command over TLS, the server certificate verified against `ca_cert`."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    with (
        socket.create_connection((HOST, port), timeout=timeout_s) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as sock,
    ):
        reader = _Reader(sock)
        sock.sendall(_encode("AUTH", password))
        reader.reply()
        sock.sendall(_encode(*args))
        return reader.reply()


@dataclass
class TlsRedis:
    """A started redis-server: TLS port, password, the CA that verifies it, and its process."""

    port: int
    password: str
    tls: TlsFiles
    child: Child

    def url(self) -> str:
        """The address as prod's head gets it (`rediss://` turns on Ray's TLS to Redis)."""
        return f"rediss://{HOST}:{self.port}"

    def command(self, *args: str) -> object:
        return redis_command(self.port, self.password, self.tls.ca_cert, *args)

    def stop(self) -> None:
        self.child.stop(grace_s=5)


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def start_tls_redis(directory: Path, *, timeout_s: float = 30.0) -> TlsRedis:
    """redis-server on 127.0.0.1 with TLS only (no plain port), a password, and no persistence."""
    executable = redis_server_path()
    if executable is None:
        raise RedisStartError("redis-server is not installed (Debian: apt-get install redis-server)")
    directory.mkdir(parents=True, exist_ok=True)
    tls = make_tls_files(directory / "tls")
    password = new_password()
    port = free_port()
    config = directory / "redis.conf"
    # ElastiCache's in-transit encryption: server TLS, no client certificates, AUTH token.
    config.write_text(
        "\n".join(
            [
                f"bind {HOST}",
                "port 0",
                f"tls-port {port}",
                f"tls-cert-file {tls.server_cert}",
                f"tls-key-file {tls.server_key}",
                f"tls-ca-cert-file {tls.ca_cert}",
                "tls-auth-clients no",
                f"requirepass {password}",
                "protected-mode yes",
                'save ""',
                "appendonly no",
                f"dir {directory}",
                "daemonize no",
                "",
            ]
        )
    )
    config.chmod(0o600)
    child = Child.start("redis", [executable, str(config)], child_env(), directory / "redis.log")
    redis = TlsRedis(port=port, password=password, tls=tls, child=child)
    deadline = time.monotonic() + timeout_s
    while True:
        if child.proc.poll() is not None:
            raise RedisStartError(f"redis-server exited with {child.proc.returncode}:\n{child.log_tail()}")
        try:
            if redis.command("PING") == "PONG":
                return redis
        except (OSError, RedisError):
            pass
        if time.monotonic() > deadline:
            redis.stop()
            raise RedisStartError(f"redis-server did not answer over TLS in {timeout_s:.0f}s:\n{child.log_tail()}")
        time.sleep(0.2)
