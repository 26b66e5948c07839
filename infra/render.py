"""Offline render: run the whole program under Pulumi's mocks and write what it declares.

    python -m infra.render --stack dev [--out DIR] [--config FILE]

No cloud, no Pulumi CLI. Writes to DIR (default build/render/<stack>/):
resources.json (every resource in creation order), manifests.yaml (every
Kubernetes object as it would reach the API server), helm.yaml (every Helm
release with its values) and outputs.json (the stack outputs). Secret
values are written as "[secret]". Same input, same bytes out. A config
error prints one line per problem and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.config import PLACEHOLDER_API_KEYS, ConfigError, read_stack_file

ROOT = Path(__file__).resolve().parent.parent
SECRET = "[secret]"
PROJECT = "llm-platform"


def stack_file(stack: str, override: Path | None = None) -> Path:
    """The stack's config file: `override` when given, else `Pulumi.<stack>.yaml` in the project."""
    return override or ROOT / f"Pulumi.{stack}.yaml"


def known_stacks() -> list[str]:
    """Stack names with a `Pulumi.<stack>.yaml` in the project."""
    return sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in ROOT.glob("Pulumi.*.yaml"))


_NOT_MANIFESTS = ("kubernetes:helm.sh/", "kubernetes:yaml", "kubernetes:kustomize")
_HELM_RELEASE = "kubernetes:helm.sh/v3:Release"


@dataclass
class Rendered:
    """What one render produced."""

    resources: list[dict[str, Any]]
    manifests: list[dict[str, Any]]
    helm: list[dict[str, Any]]
    outputs: dict[str, Any]
    # What the program logged at info level or above (`pulumi preview` shows
    # the same lines): the capacity plan and cold-start budget, per model,
    # then the upgrade headroom, per GPU group.
    log: list[str] = field(default_factory=list)


def _clean(value: Any) -> Any:
    from pulumi.runtime import rpc

    if isinstance(value, dict):
        if value.get(rpc._special_sig_key) == rpc._special_secret_sig:
            return SECRET
        return {k: _clean(v) for k, v in sorted(value.items()) if v is not None}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is rpc.UNKNOWN:
        return "[unknown]"
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _manifest(inputs: dict[str, Any]) -> dict[str, Any]:
    head: dict[str, Any] = {k: inputs[k] for k in ("apiVersion", "kind", "metadata") if k in inputs}
    return {**head, **{k: v for k, v in inputs.items() if k not in head}}


def _helm(inputs: dict[str, Any]) -> dict[str, Any]:
    chart, repository = inputs.get("chart"), (inputs.get("repositoryOpts") or {}).get("repo")
    if isinstance(chart, str) and chart.startswith("oci://"):
        # oci://<registry>/<chart>: shown as the chart and its repository, like the others.
        repository, _, chart = chart.rpartition("/")
    return {
        "name": inputs.get("name"),
        "namespace": inputs.get("namespace"),
        "chart": chart,
        "version": inputs.get("version"),
        "repository": repository,
        "values": inputs.get("values") or {},
    }


def _qualified_type(urn: str) -> str:
    """The `parent$...$type` part of a URN."""
    return urn.split("::")[2]


def engine_urn(stack: str, parent: str | None, kind: str, name: str) -> str:
    """A resource's URN as the Pulumi engine forms it.

    The mock monitor's own URNs keep only the parent's last type and count
    the stack as a parent; the engine chains every ancestor's type and
    leaves the root stack out. A golden list of URNs must use the engine's.
    """
    chain = _qualified_type(parent) if parent else ""
    qualified = f"{chain}${kind}" if chain else kind
    return f"urn:pulumi:{stack}::{PROJECT}::{qualified}::{name}"


def _alias_urn(alias: Any, stack: str, parent: str | None, kind: str, name: str) -> str:
    """The URN an alias spec stands for (engine form)."""
    if alias.urn:
        return str(alias.urn)
    spec = alias.spec
    if spec.noParent:
        parent = None
    elif spec.parentUrn:
        parent = spec.parentUrn
    return engine_urn(spec.stack or stack, parent, spec.type or kind, spec.name or name)


def _make_monitor(mocks: Any) -> Any:
    from pulumi.runtime import rpc
    from pulumi.runtime.mocks import MockMonitor

    class RecordingMonitor(MockMonitor):
        """Keeps each registration's parent, dependencies and raw inputs."""

        def __init__(self) -> None:
            super().__init__(mocks)
            self.records: list[dict[str, Any]] = []
            self.names: dict[str, str] = {}
            self.urns: dict[str, str] = {}
            self.lock = threading.Lock()

        def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - the gRPC method name
            response = super().RegisterResource(request)  # type: ignore[no-untyped-call]
            if request.type != "pulumi:pulumi:Stack":
                with self.lock:
                    # Parents register before their children, so theirs is known.
                    parent = self.urns.get(request.parent)
                    stack = response.urn.split("::")[0].removeprefix("urn:pulumi:")
                    urn = engine_urn(stack, parent, request.type, request.name)
                    self.urns[response.urn] = urn
                    self.names[response.urn] = request.name
                    self.records.append(
                        {
                            "urn": urn,
                            "aliases": [
                                _alias_urn(a, stack, parent, request.type, request.name) for a in request.aliases
                            ],
                            "type": request.type,
                            "name": request.name,
                            "parent": request.parent,
                            "depends_on": list(request.dependencies),
                            "inputs": rpc.deserialize_properties(request.object),
                            "protect": bool(request.protect),
                            "retain_on_delete": bool(request.retainOnDelete),
                        }
                    )
            return response

    return RecordingMonitor()


@dataclass
class _Declared:
    original: Any
    order: dict[tuple[str, str], int]


def _record_declaration_order() -> _Declared:
    """Number every resource as the program constructs it."""
    import pulumi

    original = pulumi.Resource.__init__
    order: dict[tuple[str, str], int] = {}

    def init(self: pulumi.Resource, t: str, name: str, *args: Any, **kwargs: Any) -> None:
        order.setdefault((t, name), len(order))
        original(self, t, name, *args, **kwargs)

    pulumi.Resource.__init__ = init  # type: ignore[method-assign]
    return _Declared(original=original, order=order)


def _print_config_error(err: Exception) -> None:
    print(str(err), file=sys.stderr)


class _Collect(logging.Handler):
    """Keeps what the program logs, in order."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _program_logger(into: list[str] | None) -> logging.Logger:
    """The logger the mock engine gives `pulumi.log`: collects into `into`, never reaches the root logger."""
    logger = logging.getLogger("llm-platform.program")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if into is not None:
        logger.addHandler(_Collect(into))
    return logger


def run_under_mocks(
    stack: str,
    config: dict[str, str],
    secret_keys: list[str],
    program: Callable[[], Coroutine[Any, Any, None]],
    log: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Run `program` under the project's mocks; return every resource it declared, in order.

    The runtime is reset first, so one process can run several programs
    (the tests do). `program` may declare resources and await outputs.
    """
    import pulumi
    from pulumi.runtime import mocks as pulumi_mocks
    from pulumi.runtime import settings
    from pulumi.runtime.stack import run_pulumi_func

    from infra import mocks as platform_mocks

    mock = platform_mocks.PlatformMocks(region=config.get("aws:region", "us-east-1"))
    monitor = _make_monitor(mock)
    # Registrations run on the loop's default executor; one worker keeps
    # the runtime's own bookkeeping in a fixed order.
    loop = asyncio.new_event_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    asyncio.set_event_loop(loop)
    settings.set_root_resource(None)  # type: ignore[arg-type]  # a fresh stack for every run
    pulumi_mocks.set_mocks(
        mock, project=PROJECT, stack=stack, preview=False, monitor=monitor, logger=_program_logger(log)
    )
    pulumi.runtime.set_all_config(config, secret_keys)
    declared = _record_declaration_order()
    try:
        # run_pulumi_func waits for every outstanding registration.
        loop.run_until_complete(run_pulumi_func(lambda: loop.create_task(program())))
    finally:
        pulumi.Resource.__init__ = declared.original  # type: ignore[method-assign]
    # Registrations reach the monitor as their inputs resolve, an order that
    # varies with thread timing; the order the program declared them does not.
    records = sorted(monitor.records, key=lambda r: declared.order.get((r["type"], r["name"]), len(declared.order)))
    names = monitor.names
    return [
        {
            "urn": r["urn"],
            **({"aliases": sorted(r["aliases"])} if r["aliases"] else {}),
            "type": r["type"],
            "name": r["name"],
            "parent": names.get(r["parent"]),
            "inputs": _clean(r["inputs"]),
            "depends_on": sorted({names[u] for u in r["depends_on"] if u in names}),
            "protect": r["protect"],
            "retain_on_delete": r["retain_on_delete"],
        }
        for r in records
    ]


def render(stack: str, config_file: Path | None = None) -> Rendered:
    """Run the program for `stack` under mocks and return what it declared.

    Raises infra.config.ConfigError for a bad config.
    """
    import pulumi
    from pulumi.runtime import settings

    path = stack_file(stack, config_file)
    config, secret_keys = read_stack_file(path)
    api_keys = "llm-platform:api_keys"
    if api_keys not in config:
        config[api_keys] = PLACEHOLDER_API_KEYS
        secret_keys.append(api_keys)

    outputs: dict[str, Any] = {}

    async def program() -> None:
        from infra.config import load
        from infra.stack import build_stack

        build_stack(load())
        root = settings.get_root_resource()
        for name, value in sorted(root.outputs.items()):  # type: ignore[union-attr]
            out = pulumi.Output.from_input(value)
            resolved = await out.future()
            outputs[name] = SECRET if await out.is_secret() else _clean(resolved)

    log: list[str] = []
    resources = run_under_mocks(stack, config, secret_keys, program, log)
    manifests = [
        _manifest(r["inputs"])
        for r in resources
        if r["type"].startswith("kubernetes:") and not r["type"].startswith(_NOT_MANIFESTS)
    ]
    helm = [_helm(r["inputs"]) for r in resources if r["type"] == _HELM_RELEASE]
    return Rendered(resources=resources, manifests=manifests, helm=helm, outputs=outputs, log=log)


def stack_document(stack: str) -> dict[str, Any]:
    """A committed stack file (`Pulumi.<stack>.yaml`) as a dict, to change and render again."""
    doc: dict[str, Any] = yaml.safe_load(stack_file(stack).read_text())
    return doc


def render_document(stack: str, doc: Mapping[str, Any]) -> Rendered:
    """Render a stack file given as a dict, under the stack's name (so its URNs compare with the committed one's).

    Raises infra.config.ConfigError for a bad config.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"Pulumi.{stack}.yaml"
        path.write_text(yaml.safe_dump(dict(doc)))
        return render(stack, path)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings so serveConfigV2 and rules stay readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def write(rendered: Rendered, out: Path) -> None:
    """Write the four render files."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "resources.json").write_text(json.dumps(rendered.resources, indent=2) + "\n")
    (out / "outputs.json").write_text(json.dumps(rendered.outputs, indent=2, sort_keys=True) + "\n")
    for name, docs in (("manifests.yaml", rendered.manifests), ("helm.yaml", rendered.helm)):
        text = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
        (out / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m infra.render", description=__doc__.split("\n")[0])
    parser.add_argument("--stack", required=True, help="stack name; reads Pulumi.<stack>.yaml")
    parser.add_argument("--out", type=Path, help="output folder (default build/render/<stack>)")
    parser.add_argument("--config", type=Path, help="render this stack config file instead")
    args = parser.parse_args(argv)
    path = stack_file(args.stack, args.config)
    if not path.is_file():
        print(f"config error: {path}: no such stack config file", file=sys.stderr)
        return 2

    try:
        rendered = render(args.stack, path)
    except ConfigError as err:
        _print_config_error(err)
        return 2
    out = args.out or ROOT / "build" / "render" / args.stack
    write(rendered, out)
    for line in rendered.log:
        print(line)
    print(
        f"rendered {args.stack}: {len(rendered.resources)} resources, {len(rendered.manifests)} manifests, "
        f"{len(rendered.helm)} helm releases -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
