"""Pieces of the AWS layer that need no render: the image tag, the ECR lifecycle, the mocks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
