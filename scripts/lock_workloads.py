"""Writes workloads/requirements.lock: what the serving image adds, each package by version and sha256.

Run by `make lock-workloads` after a change to workloads/requirements.txt
(a test fails until the lock matches it). For every exact pin it downloads
the wheel pip would pick inside the image (CPython 3.11, glibc 2.35 x86_64,
the base's Ubuntu), records its sha256, and checks its dependencies: each
must be pinned in requirements.txt at a version that satisfies it, or be one
of BASE_PROVIDES, which the base image already carries. The Dockerfile
installs the lock with `--require-hashes --no-deps --only-binary :all:`, so
nothing outside it is fetched and no setup.py runs during the build.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "workloads" / "requirements.txt"
LOCK = ROOT / "workloads" / "requirements.lock"

# Dependencies of the added packages that the base image (rayproject/ray-llm)
# already has, with why; the lock leaves them to the base so it cannot swap
# the base's torch or numpy under vLLM.
BASE_PROVIDES = {
    "torch": "vLLM's engine (runai-model-streamer imports it)",
    "numpy": "vLLM and Ray",
    "urllib3": "requests, under Ray's dashboard and job SDK",
    "python-dateutil": "pandas, under Ray Data (ray[llm])",
    "six": "python-dateutil",
    "aiohttp": "vLLM's server and Ray Serve",
    "fastapi": "vLLM's server and Ray Serve",
    "uvicorn": "vLLM's server and Ray Serve",
    "requests": "vLLM and Ray",
    "setproctitle": "vLLM (its process titles)",
}
# The image's interpreter and platform (ray-llm 2.60 is CPython 3.11 on Ubuntu 22.04).
PYTHON = "3.11"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
MARKER_ENV = {
    "python_version": PYTHON,
    "python_full_version": f"{PYTHON}.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def input_hash(text: str) -> str:
    """The sha256 of requirements.txt that a lock was made from (its header records it)."""
    return hashlib.sha256(text.encode()).hexdigest()


def pins(text: str) -> dict[str, str]:
    """requirements.txt's exact pins by canonical name; anything else there is refused."""
    found: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if not match:
            raise SystemExit(f"workloads/requirements.txt:{n}: '{line}' is not an exact pin (name==version)")
        found[canonicalize_name(match[1])] = match[2]
    return found


def _download(name: str, version: str, into: Path) -> Path:
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    args += ["--implementation", "cp", "--python-version", PYTHON, "--abi", f"cp{PYTHON.replace('.', '')}"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    target = into / name
    subprocess.run([*args, "--dest", str(target), f"{name}=={version}"], check=True)
    (wheel,) = target.glob("*.whl")
    return wheel


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(zf.read(meta).decode())
    requirements = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(MARKER_ENV)]


def check_closure(name: str, requires: list[Requirement], pinned: dict[str, str]) -> list[str]:
    """What is wrong with one package's dependencies: each must be pinned (and fit) or come with the base."""
    problems = []
    for req in requires:
        dep = canonicalize_name(req.name)
        if dep in BASE_PROVIDES:
            continue
        if dep not in pinned:
            problems.append(f"{name} needs {req}, which neither requirements.txt nor the base provides")
        elif not req.specifier.contains(pinned[dep], prereleases=True):
            problems.append(f"{name} needs {req}, but requirements.txt pins {dep}=={pinned[dep]}")
    return problems


def main() -> None:
    text = REQUIREMENTS.read_text()
    pinned = pins(text)
    lines = [
        "# Made by `make lock-workloads` (scripts/lock_workloads.py) from workloads/requirements.txt; do not edit.",
        f"# input sha256: {input_hash(text)}",
        f"# CPython {PYTHON}, linux x86_64 wheels; installed with --require-hashes --no-deps.",
        f"# From the base image: {', '.join(sorted(BASE_PROVIDES))}.",
    ]
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in sorted(pinned.items()):
            wheel = _download(name, version, Path(tmp))
            problems += check_closure(name, _requires(wheel), pinned)
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}")
    if problems:
        raise SystemExit("\n".join(problems))
    LOCK.write_text("\n".join(lines) + "\n")
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pinned)} packages")


if __name__ == "__main__":
    main()
