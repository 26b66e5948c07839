"""docs/configuration.md is what `make config-docs` prints from the config model, and it covers every key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from infra import config_reference
from infra.config import NAMESPACE

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def _rows(text: str) -> dict[str, list[str]]:
    """The reference's table rows by key: type, default, constraints, description."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", match.group(2))]
    return rows


def _stack_keys(node: Any, prefix: str) -> set[str]:
    """Every key a stack file sets, as the reference writes it (`models[].autoscaling.min_replicas`)."""
    if isinstance(node, dict):
        keys: set[str] = set()
        for name, value in node.items():
            path = f"{prefix}.{name}" if prefix else str(name)
            keys.add(path)
            if isinstance(value, (dict, list)) and name not in {"labels", "per_key", "engine_overrides"}:
                keys |= _stack_keys(value, path)
        return keys
    if isinstance(node, list) and any(isinstance(item, dict) for item in node):
        return {f"{prefix}[]"} | set().union(*(_stack_keys(item, f"{prefix}[]") for item in node))
    return set()


def test_the_committed_page_is_what_the_generator_prints() -> None:
    assert PAGE.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: rewrite it with `make config-docs` and commit it"
    )


def test_the_command_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    config_reference.main()
    assert capsys.readouterr().out == PAGE.read_text()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_key_an_example_stack_sets_is_documented(stack: str) -> None:
    doc = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())["config"]
    keys: set[str] = set()
    for name, value in doc.items():
        namespace, _, section = name.partition(":")
        if namespace != NAMESPACE:
            keys.add(name)
            continue
        keys.add(section)
        keys |= _stack_keys(value, section)
    text = PAGE.read_text()
    documented = set(_rows(text)) | set(re.findall(r"^## `([^`]+)`$", text, flags=re.MULTILINE))
    documented |= {k.removesuffix("[]") for k in documented}
    assert len(keys) > 40 and keys <= documented, sorted(keys - documented)


def test_a_row_carries_type_default_bounds_and_description() -> None:
    rows = _rows(PAGE.read_text())
    assert rows["serving.limits.max_tokens"][:3] == ["integer", "`4096`", "> 0"]
    assert "max_completion_tokens" in rows["serving.limits.max_tokens"][3]
    assert rows["storage.model_bucket"][:2] == ["string", "required"]
    assert "at most 63 characters" in rows["storage.model_bucket"][2]
    assert rows["ray.upgrade_headroom"][:2] == ["`peak` or `min`", "`peak`"]
    assert rows["cluster.log_types"][1] == "`[api, audit, authenticator]`"
    assert rows["models[].autoscaling.min_replicas"][:3] == ["integer", "`1`", ">= 0"]
    assert rows["aws:region"][:2] == ["string", "required"]
    assert "region" not in rows


class _Inner(BaseModel):
    """An inner section."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    size: int = Field(default=3, ge=1, le=9)
    """How many, from the attribute's docstring."""


class _Outer(BaseModel):
    """A model with and without descriptions."""

    mode: Literal["a", "b"] = "a"
    names: list[str] = Field(default_factory=list, min_length=1, description="Given in Field.")
    inner: _Inner = _Inner()
    items: list[_Inner] = Field(default_factory=list)
    maybe: _Inner | None = None


def test_the_generator_reads_descriptions_attribute_docstrings_and_fields_without_either() -> None:
    sections = {s.path: s for s in config_reference.sections(_Outer)}
    assert list(sections) == ["", "inner", "items[]", "maybe"]
    top = {k.path: k for k in sections[""].keys}
    assert (top["mode"].type, top["mode"].default, top["mode"].description) == ("`a` or `b`", "`a`", "")
    assert (top["names"].default, top["names"].constraints, top["names"].description) == (
        "`[]`",
        "not empty",
        "Given in Field.",
    )
    (size,) = sections["inner"].keys
    assert (size.path, size.constraints, size.description) == (
        "inner.size",
        ">= 1, <= 9",
        "How many, from the attribute's docstring.",
    )
    assert sections["items[]"].keys[0].path == "items[].size"
    assert sections["maybe"].doc == "An inner section.\n\nOptional: unset by default."


def test_a_note_for_a_key_the_model_lacks_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_reference, "NOTES", {**config_reference.NOTES, "serving.no_such_key": "stale"})
    with pytest.raises(ValueError, match=r"serving\.no_such_key"):
        config_reference.render()
