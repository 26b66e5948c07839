"""The shape of the program: layers import one way, no cycles, small functions, no Ray in infra/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from infra.render import ROOT

INFRA = ROOT / "infra"
# Lower rank first: a module may import only from its own rank or below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "config",
        (
            "infra.versions",
            "infra.citations",
            "infra.instance_types",
            "infra.config",
            "infra.scheduling",
            "infra.capacity",
        ),
    ),
    ("aws", ("infra.aws",)),
    ("platform", ("infra.cluster_services",)),
    ("serving", ("infra.serving",)),
    (
        "outputs",
        (
            "infra.stack",
            "infra.render",
            "infra.mocks",
            "infra.twin",
            "infra.plan",
            "infra.upgrade_status",
            "infra.config_reference",
        ),
    ),
]
MAX_FUNCTION_LINES = 60
# infra/config/ is one module per section: none grows back into the one long file it was.
MAX_CONFIG_MODULE_LINES = 400


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _rank(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


MODULES = {_module(p): p for p in sorted(INFRA.rglob("*.py"))}
GRAPH = {name: {m for m in MODULES if m in _imports(path) and m != name} for name, path in MODULES.items()}


def test_every_module_belongs_to_a_layer() -> None:
    assert [m for m in MODULES if m != "infra" and _rank(m) is None] == []


def test_layers_import_downwards_only() -> None:
    upward = [
        f"{src} ({LAYERS[_rank(src) or 0][0]}) imports {dst} ({LAYERS[_rank(dst) or 0][0]})"
        for src, targets in GRAPH.items()
        for dst in targets
        if _rank(src) is not None and _rank(dst) is not None and (_rank(dst) or 0) > (_rank(src) or 0)
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_checks_see_a_real_graph() -> None:
    """Guards the checks above against an empty or wrongly parsed graph."""
    assert "infra.aws.layer" in GRAPH["infra.cluster_services.build"]
    assert "infra.cluster_services.layer" in GRAPH["infra.serving.build"]
    assert _rank("infra.serving.build") == 3 and _rank("infra.aws.build") == 1


def test_infra_never_imports_ray_or_vllm() -> None:
    """The program deploys the server; it never runs it (requirements.txt has neither)."""
    heavy = {m for path in MODULES.values() for m in _imports(path) if m.split(".")[0] in {"ray", "vllm", "torch"}}
    assert heavy == set()


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_stay_small(path: Path) -> None:
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert long == []


def test_config_modules_stay_small() -> None:
    lengths = {p.name: len(p.read_text().splitlines()) for p in sorted((INFRA / "config").glob("*.py"))}
    assert len(lengths) > 10, "infra/config/ is no longer a package of section modules"
    assert {name: n for name, n in lengths.items() if n > MAX_CONFIG_MODULE_LINES} == {}


def test_the_capacity_plan_does_not_import_the_config() -> None:
    """infra/config/ calls down into infra/capacity/ and hands the plan plain values (infra/capacity/inputs.py)."""
    capacity = {name: path for name, path in MODULES.items() if name.startswith("infra.capacity")}
    assert "infra.capacity.report" in capacity
    upward = {
        name: sorted(m for m in _imports(path) if m == "infra.config" or m.startswith("infra.config."))
        for name, path in capacity.items()
    }
    assert {name: found for name, found in upward.items() if found} == {}


def _test_modules_imported(source: str, package: str) -> set[str]:
    """The test modules a module of `package` imports: absolute (tests.x.test_y) or relative (from .test_y import z)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            found |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return {name for name in found if name.startswith("tests.") and name.split(".")[-1].startswith("test_")}


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/harness.py, a helper module or fixtures, never in a test module."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name in sorted(_test_modules_imported(path.read_text(), ".".join(path.relative_to(ROOT).parent.parts)))
    ]
    assert offenders == []


def test_relative_and_absolute_imports_of_a_test_module_are_seen() -> None:
    source = "from .test_guard_e2e import headers\nfrom ..harness import STACKS\nimport tests.test_render\n"
    assert _test_modules_imported(source, "tests.e2e") == {"tests.e2e.test_guard_e2e", "tests.test_render"}
