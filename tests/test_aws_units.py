"""Pieces of the AWS layer that need no render: image tag, ECR lifecycle, mocks, component signatures."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path
from types import ModuleType

import pulumi
import pytest

import infra.aws
from infra import mocks
from infra.aws import registry
from infra.aws.kubernetes import KubernetesAccessArgs


def _context(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "Dockerfile").write_text("FROM scratch\n")
    (root / ".dockerignore").write_text("*\n!pkg/\npkg/**/__pycache__\n")
    (root / "pkg" / "app.py").write_text("print('a')\n")
    return root


def test_image_tag_follows_what_the_build_sends_and_nothing_else(tmp_path: Path) -> None:
    root = _context(tmp_path)
    tag = registry.image_tag(root)
    assert re.fullmatch(r"\d+\.\d+\.\d+-[0-9a-f]{12}", tag)
    assert registry.image_tag(root) == tag
    # Files the build context leaves out do not move the tag...
    (root / "notes.md").write_text("x")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "app.pyc").write_bytes(b"\0")
    assert registry.image_tag(root) == tag
    # ...the sources and the Dockerfile do.
    (root / "pkg" / "app.py").write_text("print('b')\n")
    changed = registry.image_tag(root)
    assert changed != tag
    (root / "Dockerfile").write_text("FROM scratch\nUSER 1000\n")
    assert registry.image_tag(root) != changed


def test_lifecycle_expires_untagged_first_and_keeps_the_newest() -> None:
    rules = json.loads(registry.lifecycle_policy())["rules"]
    assert [r["rulePriority"] for r in rules] == [1, 2]
    untagged, keep = rules
    assert untagged["selection"] == {
        "tagStatus": "untagged",
        "countType": "sinceImagePushed",
        "countUnit": "days",
        "countNumber": 7,
    }
    assert keep["selection"] == {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": 30}
    assert all(r["action"] == {"type": "expire"} for r in rules)


def test_provider_source_is_exactly_one_of_kubeconfig_and_context() -> None:
    with pytest.raises(ValueError):
        KubernetesAccessArgs()
    assert KubernetesAccessArgs(context="ctx").context == "ctx"


@pytest.mark.parametrize("token", sorted(mocks.TYPE_OUTPUTS))
def test_mock_outputs_are_deterministic(token: str) -> None:
    inputs = {
        "name": "x",
        "bucket": "b",
        "length": 40,
        "availabilityZoneNames": ["us-east-1a", "us-east-1b"],
        "nodeGroupNamePrefix": "gpu-",
        "replicationGroupId": "rg",
        "tags": ["repo:tag"],
    }
    fn = mocks.TYPE_OUTPUTS[token]
    first = json.dumps(fn("res", dict(inputs), "us-east-1"), sort_keys=True)
    assert json.dumps(fn("res", dict(inputs), "us-east-1"), sort_keys=True) == first


def test_mock_digest_and_password_have_the_real_shapes() -> None:
    image = mocks.TYPE_OUTPUTS["docker-build:index:Image"]("serving-image", {}, "us-east-1")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", image["digest"])
    password = mocks.TYPE_OUTPUTS["random:index/randomPassword:RandomPassword"]("p", {"length": 64}, "us-east-1")
    assert re.fullmatch(r"[0-9a-f]{64}", password["result"])


def test_a_new_base_image_gets_a_new_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _context(tmp_path)
    tag = registry.image_tag(root)
    monkeypatch.setattr(registry.versions, "RAY_LLM_BASE_IMAGE", "rayproject/ray-llm:9.9.9-py311-cu128")
    assert registry.image_tag(root) != tag


def test_the_build_uses_the_pinned_base_image_and_the_dockerfile_default_agrees() -> None:
    dockerfile = (registry.WORKLOADS / "Dockerfile").read_text()
    defaults = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, flags=re.MULTILINE)
    assert defaults == [registry.versions.RAY_LLM_BASE_IMAGE]
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, flags=re.MULTILINE)


def _aws_modules() -> list[ModuleType]:
    package = Path(infra.aws.__file__).parent
    return [
        importlib.import_module(f"infra.aws.{p.stem}") for p in sorted(package.glob("*.py")) if p.stem != "__init__"
    ]


def test_component_args_carry_no_providers_or_dependencies() -> None:
    """Providers and `depends_on` travel in each component's `opts`; its children inherit them as `parent=self`.

    Checked on every input dataclass (the `*Args` of the components, the
    provisioners' NodeTarget); what the layer hands down (AwsLayer) carries
    the provider and `cluster_ready` on purpose.
    """
    checked = []
    for module in _aws_modules():
        for cls in vars(module).values():
            if not (dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            if not (cls.__name__.endswith("Args") or cls.__name__ == "NodeTarget"):
                continue
            for f in dataclasses.fields(cls):
                kind = str(f.type)
                assert f.name not in {"after", "depends_on", "provider", "providers", "opts"}, (cls, f.name)
                assert "Resource" not in kind and "Provider" not in kind, (cls, f.name, kind)
            checked.append(cls.__name__)
    assert {"NodeGroupArgs", "AddonsArgs", "ClusterArgs", "NodeTarget", "PrivateBucketArgs"} <= set(checked)


def test_every_component_takes_resource_options() -> None:
    components = [
        cls
        for module in _aws_modules()
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, pulumi.ComponentResource) and cls.__module__ == module.__name__
    ]
    assert len(components) >= 10
    for cls in components:
        opts = inspect.signature(cls.__init__).parameters.get("opts")
        assert opts is not None and opts.default is None, cls
