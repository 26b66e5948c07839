"""Runbooks: every alert links its page in docs/runbooks/, every page belongs to an alert, and
what a page tells an operator to run is checked against the platform it runs on (the rule's own
expression, PromQL that parses and reads known series, the namespaces, labels, make targets, stack
outputs and config keys that exist)."""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import shutil
import subprocess
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from infra.aws.identities import KUBE_SYSTEM
from infra.cluster_services import kuberay as kuberay_operator
from infra.config import ConfigError, Model, Slo, StackConfig, parse, vllm_engine_args
from infra.render import ROOT
from infra.serving import alerts, kuberay
from infra.serving.batch import WORKER_NAME as BATCH_WORKER
from infra.serving.gateway import GATEWAY_LABEL
from infra.serving.router import ROUTER_NAME_LABEL, ROUTER_OF
from tests.harness import manifests_of, render_config, render_stack, stack_doc, stack_sections
from tests.promql import metrics_in

RUNBOOKS = ROOT / alerts.RUNBOOK_DIR
INDEX = RUNBOOKS / "README.md"
ALERT_NAMES = [a.name for a in alerts.ALERTS]
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p != INDEX)
SECTIONS = ["What it means", "Check first", "Usual fixes"]
CHECKS = 3
# The namespace the pages' serving commands use: the committed stacks'.
NAMESPACE = "llm"
# Namespaces a page may send kubectl to: serving, the KubeRay operator's, cluster-autoscaler's.
NAMESPACES = {NAMESPACE, kuberay_operator.NAMESPACE, KUBE_SYSTEM}
# Pod labels a page may select or show, and the values it may give them.
LABELS: dict[str, set[str] | None] = {
    kuberay.SERVICE_LABEL: None,
    kuberay.CLUSTER: None,
    kuberay.GROUP: None,
    kuberay.NODE_TYPE: {"head", "worker"},
    "app.kubernetes.io/name": {BATCH_WORKER, GATEWAY_LABEL["app.kubernetes.io/name"], *ROUTER_NAME_LABEL.values()},
    ROUTER_OF: None,
}
# The recording rules' series, and those the capacity plan records per model.
RECORDED = {r.record for r in alerts.RECORDING_RULES} | alerts.PLAN_RECORDS | set(alerts.PER_MODEL_RECORDS)


def _page(alert: str) -> Path:
    return RUNBOOKS / f"{alert}.md"


# --- The annotation. ---


def _alert_rules(rendered: Any) -> list[dict[str, Any]]:
    (rule,) = [r for r in manifests_of(rendered, "PrometheusRule") if r["metadata"]["name"] == alerts.RULE_NAME]
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_alert_links_its_runbook_page(stack: str) -> None:
    rules = _alert_rules(render_stack(stack))
    assert [r["alert"] for r in rules] == ALERT_NAMES
    for rule in rules:
        # Neither committed stack names a base URL: the link is the page's path in the repository.
        url = rule["annotations"]["runbook_url"]
        assert url == f"{alerts.RUNBOOK_DIR}/{rule['alert']}.md"
        assert (ROOT / url).is_file(), f"{rule['alert']}: {url} does not exist"


def test_the_base_url_comes_from_the_stacks_config() -> None:
    """From Pulumi.<stack>.yaml through the serving layer into every alert of the rendered rule."""
    base = "https://git.example.com/platform/llm-platform/blob/main/docs/runbooks"
    doc = copy.deepcopy(stack_doc("dev"))
    doc["config"]["llm-platform:observability"]["runbook_base_url"] = base + "/"
    rules = _alert_rules(render_config(doc))
    assert {r["alert"]: r["annotations"]["runbook_url"] for r in rules} == {
        name: f"{base}/{name}.md" for name in ALERT_NAMES
    }


def test_a_runbook_url_is_its_base_and_the_alerts_page() -> None:
    assert alerts.runbook_url("A") == "docs/runbooks/A.md"
    assert alerts.runbook_url("A", "https://h/docs/runbooks") == "https://h/docs/runbooks/A.md"
    assert alerts.runbook_url("A", "https://h/docs/runbooks/") == "https://h/docs/runbooks/A.md"


@pytest.mark.parametrize(
    "base",
    [
        "docs/runbooks",
        "git.example.com/docs/runbooks",
        "ftp://git.example.com/docs/runbooks",
        "https:///docs/runbooks",
        "https://git.example.com/docs/runbooks?ref=main",
        "https://git.example.com/docs/runbooks#top",
        "https://git.example.com/docs runbooks",
    ],
)
def test_a_base_url_the_pages_can_not_sit_under_is_refused_in_one_line(base: str) -> None:
    raw = stack_sections("dev")
    raw["observability"] = {**raw.get("observability", {}), "runbook_base_url": base}
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert [str(p) for p in info.value.problems] == [
        f"config error: observability.runbook_base_url: '{base}' is not a base URL for the runbooks: "
        "http(s)://host/path with no query or fragment, where docs/runbooks/ is served "
        "(each alert links <base>/<AlertName>.md)"
    ]


# --- Pages and alerts, one for one. ---


def test_every_page_belongs_to_an_alert() -> None:
    assert sorted(p.stem for p in PAGES) == sorted(ALERT_NAMES)


def test_the_index_lists_every_page() -> None:
    links = {target for _, target in _links(INDEX.read_text())}
    pages = {f"{name}.md" for name in ALERT_NAMES}
    assert pages <= links, f"docs/runbooks/README.md does not link {sorted(pages - links)}"
    assert not {t for t in links if re.fullmatch(r"[A-Z]\w+\.md", t)} - pages


# --- A page's shape. ---


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and its text, dedented."""

    lang: str
    text: str


def _blocks(text: str) -> list[Block]:
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"(\s*)```(\w*)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        indent, body = len(fence.group(1)), []
        i += 1
        while lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        out.append(Block(fence.group(2), "\n".join(body)))
        i += 1
    return out


def _prose(text: str) -> str:
    """The text outside code blocks."""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.MULTILINE | re.DOTALL)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_every_page_has_the_three_sections(alert: str) -> None:
    text = _page(alert).read_text()
    assert text.splitlines()[0] == f"# {alert}"
    assert list(_sections(text)) == SECTIONS, f"{alert}.md: sections must be {SECTIONS}"


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_the_first_checks_are_three_and_each_gives_a_query_or_a_command(alert: str) -> None:
    checks = _sections(_page(alert).read_text())["Check first"]
    items = re.split(r"^(\d+)\. ", checks, flags=re.MULTILINE)
    assert items[1::2] == [str(n) for n in range(1, CHECKS + 1)], f"{alert}.md: {CHECKS} numbered checks"
    for number, body in zip(items[1::2], items[2::2], strict=True):
        langs = {b.lang for b in _blocks(body)}
        assert langs & {"promql", "sh"}, f"{alert}.md check {number} has no PromQL or shell block"


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_the_page_shows_the_rules_expression(alert: str) -> None:
    """As rendered with the default SLOs in `llm`: a changed rule fails here until its page follows."""
    (rule,) = [r for r in alerts.alert_rules(Slo(), NAMESPACE) if r["alert"] == alert]
    meaning = _sections(_page(alert).read_text())["What it means"]
    assert Block("promql", rule["expr"].strip()) in _blocks(meaning), f"{alert}.md does not show {rule['expr']!r}"


# --- What a page tells an operator to run. ---


def _all_blocks(lang: str) -> Iterator[tuple[str, str]]:
    for path in [*PAGES, INDEX]:
        for block in _blocks(path.read_text()):
            if block.lang == lang:
                yield path.name, block.text


PROMQL = list(_all_blocks("promql"))
SHELL = list(_all_blocks("sh"))


def test_every_query_reads_series_the_rules_read() -> None:
    assert PROMQL
    for page, expr in PROMQL:
        used = metrics_in(expr)
        assert used, f"{page}: {expr!r} reads no series"
        known = alerts.KNOWN_METRICS | RECORDED
        assert used <= known, f"{page}: not in the inventory or the recording rules: {sorted(used - known)}"


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = [{"record": f"runbook:query{i}:check", "expr": expr} for i, (_, expr) in enumerate(PROMQL)]
    path = tmp_path / "runbook-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "runbooks", "rules": rules}]}, sort_keys=False))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _segments(line: str) -> Iterator[str]:
    """The simple commands of one shell line: split at unquoted `|`, `;`, `&&`, each `$(...)` its own
    (its place in the outer command taken by a word, `X`)."""
    stack: list[tuple[list[str], str | None]] = [([], None)]
    quote: str | None = None
    i = 0
    while i < len(line):
        c, buf = line[i], stack[-1][0]
        if quote == "'":
            quote = None if c == "'" else quote
            buf.append(c)
        elif line.startswith("$(", i):
            stack.append(([], quote))
            quote = None
            i += 1
        elif c == ")" and quote is None and len(stack) > 1:
            inner, quote = stack.pop()
            yield "".join(inner)
            stack[-1][0].append("X")
        elif quote == '"':
            quote = None if c == '"' else quote
            buf.append(c)
        elif c in "'\"":
            quote = c
            buf.append(c)
        elif c in "|;&":
            yield "".join(buf)
            buf.clear()
        else:
            buf.append(c)
        i += 1
    for buf, _ in stack:
        yield "".join(buf)


def _commands(script: str) -> Iterator[list[str]]:
    """Each simple command of a shell block, as words."""
    for line in script.replace("\\\n", " ").splitlines():
        for segment in _segments(line):
            words = shlex.split(segment)
            if words:
                yield words


def test_the_shell_reader_finds_every_command() -> None:
    script = (
        "kubectl exec -n llm $(kubectl get pods -l a=b -o name | head -1) -c ray -- sh -c 'grep \"x|y\" f | tail'\n"
        "aws sqs x --url \"$(pulumi stack output q --stack s)\" \\\n  --n 1; make up && echo 'a)b'"
    )
    assert [w[:2] for w in _commands(script)] == [
        ["kubectl", "get"],
        ["head", "-1"],
        ["kubectl", "exec"],
        ["pulumi", "stack"],
        ["aws", "sqs"],
        ["make", "up"],
        ["echo", "a)b"],
    ]
    (exec_,) = [w for w in _commands(script) if w[:2] == ["kubectl", "exec"]]
    assert exec_[4:6] == ["X", "-c"] and exec_[-1] == 'grep "x|y" f | tail'


def _option(words: list[str], *names: str) -> list[str]:
    values = []
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                values.append(words[i + 1])
            elif name.startswith("--") and word.startswith(name + "="):
                values.append(word.split("=", 1)[1])
    return values


def test_kubectl_goes_to_the_platforms_namespaces_and_labels() -> None:
    kubectl = [(page, w) for page, script in SHELL for w in _commands(script) if w[0] == "kubectl"]
    assert kubectl
    for page, words in kubectl:
        for namespace in _option(words, "-n", "--namespace"):
            assert namespace in NAMESPACES, f"{page}: {' '.join(words)}: namespace {namespace}"
        for selector in _option(words, "-l", "--selector"):
            for term in selector.split(","):
                key, _, value = re.split(r"(!=|==|=)", term, maxsplit=1) if "=" in term else (term, "", "")
                assert key in LABELS, f"{page}: selects on {key}, which no pod of the platform carries"
                allowed = LABELS[key]
                assert allowed is None or value in allowed, f"{page}: {key}={value}"
        for columns in _option(words, "-L", "--label-columns"):
            assert set(columns.split(",")) <= set(LABELS), f"{page}: shows {columns}"


def test_make_targets_modules_and_stack_outputs_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    outputs = set(render_stack("prod").outputs)
    for page, script in SHELL:
        for words in _commands(script):
            if words[0] == "make":
                assert re.search(rf"^{re.escape(words[1])}:", makefile, re.MULTILINE), f"{page}: make {words[1]}"
            if words[:2] == ["python", "-m"]:
                assert importlib.util.find_spec(words[2]) is not None, f"{page}: python -m {words[2]}"
            if words[:3] == ["pulumi", "stack", "output"]:
                assert words[3] in outputs, f"{page}: no stack output {words[3]}"


def _types(hint: Any) -> Iterator[Any]:
    yield hint
    origin = typing.get_origin(hint)
    if origin is not None:
        yield origin
    for arg in typing.get_args(hint):
        yield from _types(arg)


def _resolves(model: type[BaseModel], parts: list[str]) -> bool:
    """Whether `a.b[].c` names a field of `model` (engine_overrides' keys: vLLM's engine arguments)."""
    name, rest = parts[0].removesuffix("[]"), parts[1:]
    if name not in model.model_fields:
        return False
    if not rest:
        return True
    for hint in _types(typing.get_type_hints(model)[name]):
        if isinstance(hint, type) and issubclass(hint, BaseModel) and _resolves(hint, rest):
            return True
        if hint is dict and name == "engine_overrides":
            return len(rest) == 1 and rest[0] in vllm_engine_args()[1]
    return False


CONFIG_KEY = re.compile(r"[a-z_]+(\[\])?(\.[a-z_]+(\[\])?)+")


def test_every_config_key_a_page_names_exists() -> None:
    """A key from the stack's top (`models[].autoscaling.max_replicas`) or a model's (`engine_overrides.x`)."""
    named = 0
    for path in [*PAGES, INDEX]:
        for code in re.findall(r"`([^`\n]+)`", _prose(path.read_text())):
            key = code.split(":", 1)[0].strip()
            if not CONFIG_KEY.fullmatch(key):
                continue
            parts = key.split(".")
            if parts[0].removesuffix("[]") not in StackConfig.model_fields | Model.model_fields:
                continue
            named += 1
            assert _resolves(StackConfig, parts) or _resolves(Model, parts), f"{path.name}: no config key {key}"
    assert named > 20


# --- Links. ---


def _links(text: str) -> Iterator[tuple[str, str]]:
    """(text, target) of every inline link outside code blocks."""
    yield from re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", _prose(text))


def _anchors(path: Path) -> set[str]:
    """The heading ids GitHub gives a page."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", _prose(path.read_text()), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_resolves() -> None:
    checked = 0
    for path in sorted(RUNBOOKS.glob("*.md")):
        for _, target in _links(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            assert resolved.exists(), f"{path.name}: {target} does not exist"
            if anchor:
                assert anchor in _anchors(resolved), f"{path.name}: {target}: no heading #{anchor}"
            checked += 1
    assert checked > len(ALERT_NAMES)
