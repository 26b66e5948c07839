"""Program scale: render time under mocks of stacks with 1, 4, 16 and 64 models.

    python -m benchmarks.render_scale [--repeats 3] [--sizes 1,4,16,64]

Each stack file is Pulumi.prod.yaml with its ``models`` list replaced by N
models, alternating the prod file's two models (an 8B model on one L40S, a
70B model over four) under new names; the GPU groups' max_size grows so the
fleet fits an upgrade at peak. Every render runs in a fresh subprocess (the
Pulumi runtime is process-global) exactly as ``python -m infra.render`` does,
sizes alternated within each repeat, and reports the time of the render call
itself and of the whole process (interpreter and imports included).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PROD = REPO / "Pulumi.prod.yaml"
RESULTS = Path(__file__).resolve().parent / "results"
# Progress lines reach a log file as they happen.
LOG = partial(print, flush=True)
SIZES = (1, 4, 16, 64)
WORKER_TIMEOUT_S = 900


def fleet_config(n: int, base: Path = PROD) -> dict[str, Any]:
    """Pulumi.prod.yaml with ``n`` models cloned from its own, renamed apart."""
    doc: dict[str, Any] = yaml.safe_load(base.read_text())
    config = doc["config"]
    templates = config["llm-platform:models"]
    models = []
    for i in range(n):
        model = copy.deepcopy(templates[i % len(templates)])
        # The prod models keep their names: other sections (batch) refer to them.
        if i >= len(templates):
            model["name"] = f"{model['name']}-{i:02d}"
            model["model_id"] = f"{model['model_id']}-{i:02d}"
            # Same weights: the capacity plan knows their geometry by source.
        models.append(model)
    config["llm-platform:models"] = models
    # A NewCluster upgrade started at peak needs the old cluster at its
    # max_replicas and the new one at its starting replicas, as the config rules
    # demand (ray.upgrade_headroom: peak): each group grows to fit its models.
    for group in config["llm-platform:node_groups"]["gpu"]:
        members = [m for m in models if m["gpu_group"] == group["name"]]
        # A 4-GPU model fills a whole g6e.12xlarge; a 1-GPU model one g6e.2xlarge: one node a replica here.
        need = sum(int(m["autoscaling"]["max_replicas"]) + _starting_replicas(m) for m in members)
        group["max_size"] = max(int(group["max_size"]), need)
    return doc


def _starting_replicas(model: dict[str, Any]) -> int:
    scaling = model["autoscaling"]
    return int(scaling.get("initial_replicas") or scaling["min_replicas"])


@dataclass
class Sample:
    """One render in a fresh process."""

    label: str
    models: int
    repeat: int
    render_s: float
    process_s: float
    resources: int
    manifests: int
    helm_releases: int
    by_provider: dict[str, int]


def _worker(config_file: Path) -> None:
    """In the child: one render, timed, as ``python -m infra.render`` does it."""
    t0 = time.perf_counter()
    from infra.render import render

    t1 = time.perf_counter()
    rendered = render("prod", config_file)
    t2 = time.perf_counter()
    providers = Counter(r["type"].split(":", 1)[0] for r in rendered.resources)
    print(
        json.dumps(
            {
                "import_s": t1 - t0,
                "render_s": t2 - t1,
                "resources": len(rendered.resources),
                "manifests": len(rendered.manifests),
                "helm_releases": len(rendered.helm),
                "by_provider": dict(sorted(providers.items())),
            }
        )
    )


def render_once(label: str, models: int, repeat: int, config_file: Path) -> Sample:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.render_scale", "--worker", str(config_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
        check=False,
    )
    process_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"render of {label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return Sample(
        label=label,
        models=models,
        repeat=repeat,
        render_s=data["render_s"],
        process_s=process_s,
        resources=data["resources"],
        manifests=data["manifests"],
        helm_releases=data["helm_releases"],
        by_provider=data["by_provider"],
    )


@dataclass
class ScaleResults:
    sizes: list[int]
    repeats: int
    samples: list[Sample]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScaleResults:
        return cls(
            sizes=data["sizes"],
            repeats=data["repeats"],
            samples=[Sample(**s) for s in data["samples"]],
            seconds=data["seconds"],
        )


def run(sizes: list[int], repeats: int, log: Any = LOG) -> ScaleResults:
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench_render_"))
    files: dict[str, tuple[int, Path]] = {
        "prod": (len(yaml.safe_load(PROD.read_text())["config"]["llm-platform:models"]), PROD)
    }
    for n in sizes:
        path = work / f"Pulumi.fleet-{n}.yaml"
        path.write_text(yaml.safe_dump(fleet_config(n), sort_keys=False))
        files[f"{n} models"] = (n, path)
    labels = list(files)
    samples: list[Sample] = []
    for repeat in range(repeats):
        # Rotate the order each repeat: no size always runs first (cold page cache) or last.
        order = labels[repeat % len(labels) :] + labels[: repeat % len(labels)]
        for label in order:
            n, path = files[label]
            sample = render_once(label, n, repeat, path)
            samples.append(sample)
            log(
                f"[render] repeat {repeat + 1}/{repeats} {label:<10} {sample.resources:5d} resources "
                f"render {sample.render_s:6.2f}s  process {sample.process_s:6.2f}s"
            )
    return ScaleResults(sizes=sizes, repeats=repeats, samples=samples, seconds=time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--out", type=Path, default=RESULTS / "render.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    results = run([int(s) for s in args.sizes.split(",")], args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    print(f"[render] wrote {args.out} in {results.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
