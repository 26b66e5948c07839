"""The serving image: an ECR repository, and the image built from workloads/ and pinned by digest."""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_aws as aws
import pulumi_docker_build as docker_build

from infra import versions

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
UNTAGGED_EXPIRY_DAYS = 7
KEEP_IMAGES = 30
# Build caches kept: one per dependency set (cache_tag), the newest first.
KEEP_CACHES = 10
# What the dependency layers are built from: a change to any of these starts
# a new cache (the package's own sources only change the top layers).
CACHE_INPUTS = ("Dockerfile", "requirements.lock")


# Printed on every preview while infra/versions.py has no digest for the base (make pin-base).
UNPINNED_BASE_WARNING = (
    f"the serving image builds FROM {versions.RAY_LLM_BASE_TAG} by its tag, which can be pushed again: "
    "run `make pin-base` where Docker Hub is reachable and commit the digest it writes"
)


def _dockerignore(root: Path) -> list[tuple[bool, str]]:
    path = root / ".dockerignore"
    if not path.is_file():
        return []
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, line.removeprefix("!").strip("/")))
    return rules


def _excluded(rel: str, rules: list[tuple[bool, str]]) -> bool:
    # .dockerignore semantics: the last pattern that matches the path or one
    # of its parent directories decides; `**/` also matches no directory.
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in rules:
        candidates = {pattern, pattern.replace("**/", "")}
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            excluded = not negated
    return excluded


def content_hash(root: Path = WORKLOADS) -> str:
    """A hash of what the build sends: the Dockerfile and the context after .dockerignore.

    The same sources give the same tag; a file the build never sees does not
    move it.
    """
    # The base image is part of what is inside: a new base must get a new
    # tag, or the immutable repository refuses the push.
    digest = hashlib.sha256(versions.RAY_LLM_BASE_IMAGE.encode() + b"\0")
    if root.is_dir():
        rules = _dockerignore(root)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if rel == "Dockerfile" or not _excluded(rel, rules):
                digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_tag(root: Path = WORKLOADS) -> str:
    """`deps-<16 hex>`: the build cache of one base digest, Dockerfile and lock; written once, never moved.

    The cache repository's tags are immutable, like the image repository's:
    a cache manifest, once pushed, is what every later build with the same
    dependencies reads, and nobody can push over it. A build whose cache
    already exists reads it and its own export is refused, which the build
    ignores (`ignore_error`). BuildKit checks each cached layer against the
    digest the cache manifest names, so the manifest is the only thing to
    trust, and its tag can not be rewritten.
    """
    digest = hashlib.sha256(versions.RAY_LLM_BASE_IMAGE.encode() + b"\0")
    for name in CACHE_INPUTS:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return f"deps-{digest.hexdigest()[:16]}"


def image_tag(root: Path = WORKLOADS) -> str:
    """`<ray version>-<12 hex of the content hash>`: names what is inside, never moves."""
    return f"{versions.RAY_VERSION}-{content_hash(root)[:12]}"


def lifecycle_policy() -> str:
    """Expire untagged images after a week; keep the newest images beyond that."""
    return json.dumps(
        {
            "rules": [
                {
                    "rulePriority": 1,
                    "description": f"expire untagged images after {UNTAGGED_EXPIRY_DAYS} days",
                    "selection": {
                        "tagStatus": "untagged",
                        "countType": "sinceImagePushed",
                        "countUnit": "days",
                        "countNumber": UNTAGGED_EXPIRY_DAYS,
                    },
                    "action": {"type": "expire"},
                },
                {
                    "rulePriority": 2,
                    "description": f"keep the last {KEEP_IMAGES} images",
                    "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": KEEP_IMAGES},
                    "action": {"type": "expire"},
                },
            ]
        },
        sort_keys=True,
    )


def _cache_lifecycle_policy() -> str:
    # One tag per dependency set, never moved: keep the newest few (an old
    # set is rebuilt from scratch if it ever comes back); untagged manifests
    # are left by a refused export.
    return json.dumps(
        {
            "rules": [
                {
                    "rulePriority": 1,
                    "description": "expire untagged cache manifests",
                    "selection": {
                        "tagStatus": "untagged",
                        "countType": "sinceImagePushed",
                        "countUnit": "days",
                        "countNumber": 1,
                    },
                    "action": {"type": "expire"},
                },
                {
                    "rulePriority": 2,
                    "description": f"keep the last {KEEP_CACHES} build caches",
                    "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": KEEP_CACHES},
                    "action": {"type": "expire"},
                },
            ]
        },
        sort_keys=True,
    )


def image_repository(
    name: str, repository_name: str, tags: dict[str, str], parent: pulumi.Resource
) -> aws.ecr.Repository:
    """A repository pods pull from by digest: immutable tags, scanned on push, KMS-encrypted, kept.

    Running pods pull by digest from here: the repository must survive a
    destroy or a rename of the stack.
    """
    repository = aws.ecr.Repository(
        name,
        name=repository_name,
        image_tag_mutability="IMMUTABLE",
        image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
        encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS")],
        force_delete=False,
        tags=tags,
        opts=pulumi.ResourceOptions(parent=parent, protect=True, retain_on_delete=True),
    )
    aws.ecr.LifecyclePolicy(
        name, repository=repository.name, policy=lifecycle_policy(), opts=pulumi.ResourceOptions(parent=parent)
    )
    return repository


def push_credentials(repository: aws.ecr.Repository) -> docker_build.RegistryArgs:
    """What a build pushes to `repository` with: the registry's address and a short-lived token (secret)."""
    token = aws.ecr.get_authorization_token_output(registry_id=repository.registry_id)
    return docker_build.RegistryArgs(
        address=repository.repository_url.apply(lambda url: url.split("/", 1)[0]),
        username=token.user_name,
        password=pulumi.Output.secret(token.password),
    )


@dataclass(frozen=True)
class RegistryArgs:
    """Where the image goes and whether to build it."""

    repository_name: str
    # A digest-pinned reference from config: use it and build nothing.
    reference: str | None = None
    context: Path = WORKLOADS
    tags: dict[str, str] = field(default_factory=dict)


class ServingImage(pulumi.ComponentResource):
    """The ECR repository and the serving image, exported as `repository@sha256:...`.

    The repository's tags are immutable and scanned on push; the build cache
    lives in a second repository, immutable too, one tag per dependency set
    (`cache_tag`). The base is pulled by digest (infra/versions.py). The image
    is not built during preview (the CUDA base image is many GB); the
    reference is pinned to the digest the push returned, never to a tag.
    """

    repository_url: pulumi.Output[str]
    reference: pulumi.Output[str]

    def __init__(self, name: str, args: RegistryArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:ServingImage", name, None, opts)
        self.repository = self._repository(name, args)
        self.repository_url = self.repository.repository_url
        if args.reference is not None:
            self.reference = pulumi.Output.from_input(args.reference)
            self.register_outputs({"repository_url": self.repository_url, "reference": self.reference})
            return
        self.cache_repository = self._cache_repository(name, args)
        tag = image_tag(args.context)
        self.image = self._build(name, args, tag)
        self.reference = pulumi.Output.all(self.repository_url, self.image.digest).apply(lambda a: f"{a[0]}@{a[1]}")
        self.register_outputs({"repository_url": self.repository_url, "reference": self.reference, "tag": tag})

    def _repository(self, name: str, args: RegistryArgs) -> aws.ecr.Repository:
        """The image repository: immutable tags, scanned on push, KMS-encrypted, kept."""
        return image_repository(name, args.repository_name, args.tags, self)

    def _cache_repository(self, name: str, args: RegistryArgs) -> aws.ecr.Repository:
        """The build cache's repository: immutable tags (`cache_tag`), the newest caches kept."""
        child = pulumi.ResourceOptions(parent=self)
        cache = aws.ecr.Repository(
            f"{name}-cache",
            name=f"{args.repository_name}-cache",
            image_tag_mutability="IMMUTABLE",
            encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS")],
            force_delete=True,
            tags=args.tags,
            opts=child,
        )
        aws.ecr.LifecyclePolicy(f"{name}-cache", repository=cache.name, policy=_cache_lifecycle_policy(), opts=child)
        return cache

    def _build(self, name: str, args: RegistryArgs, tag: str) -> docker_build.Image:
        """Builds workloads/ for linux/amd64 (never during preview) and pushes it as `<repository>:<tag>`."""
        cache = cache_tag(args.context)
        cache_ref = self.cache_repository.repository_url.apply(lambda url: f"{url}:{cache}")
        if not versions.RAY_LLM_BASE_PINNED:
            pulumi.log.warn(UNPINNED_BASE_WARNING, resource=self)
        return docker_build.Image(
            name,
            context=docker_build.BuildContextArgs(location=str(args.context)),
            dockerfile=docker_build.DockerfileArgs(location=str(args.context / "Dockerfile")),
            build_args={"BASE_IMAGE": versions.RAY_LLM_BASE_IMAGE},
            platforms=[docker_build.Platform.LINUX_AMD64],
            tags=[self.repository_url.apply(lambda url: f"{url}:{tag}")],
            push=True,
            build_on_preview=False,
            registries=[push_credentials(self.repository)],
            cache_from=[docker_build.CacheFromArgs(registry=docker_build.CacheFromRegistryArgs(ref=cache_ref))],
            cache_to=[
                docker_build.CacheToArgs(
                    registry=docker_build.CacheToRegistryArgs(
                        ref=cache_ref,
                        mode=docker_build.CacheMode.MAX,
                        # ECR stores a cache only as an OCI image manifest.
                        image_manifest=True,
                        oci_media_types=True,
                        # The tag exists when an earlier build made this
                        # cache: the immutable repository refuses the export,
                        # and the image is pushed all the same.
                        ignore_error=True,
                    )
                )
            ],
            opts=pulumi.ResourceOptions(parent=self),
        )
