"""The request router's front image, copied into the platform's own registry and run by digest.

The routers' front is upstream nginx (infra/serving/router_front.py says why),
named in infra/versions.py by tag until `make pin-base` resolves its digest
where ECR Public is reachable. A pod that names a tag runs whatever the tag
names at each start, and the policy pack's mandatory
`images-pinned-by-digest` refuses it. So the stack copies the image into an
ECR repository of its own, as the serving image is pushed, and the routers
run the digest that push returned: what the first `pulumi up` copied is what
every router pod runs, whichever node pulls it and whenever, until the
source changes in infra/versions.py. The copy also keeps node
pulls in the region's private registry (no public registry on the path of a
scale-up) and gets the same scan on push as the serving image.

Until the source is pinned, what the first push copied is what the tag named
then; the preview says so, as it does for the serving image's base.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_docker_build as docker_build

from infra import versions
from infra.aws.registry import image_repository, push_credentials

# The build: infra/aws/router_front/Dockerfile, alone in its context (the
# provider hashes the context to decide whether to build again, so nothing
# else may sit there). It takes the upstream image as BASE_IMAGE and adds
# only labels.
CONTEXT = Path(__file__).resolve().parent / "router_front"

UNPINNED_SOURCE_WARNING = (
    f"the router's front is copied from {versions.ROUTER_FRONT_TAG} by its tag, which can be pushed again "
    "(the routers run the copy by digest): run `make pin-base` where ECR Public is reachable and commit "
    "the digest it writes"
)


def front_tag(source: str = versions.ROUTER_FRONT_IMAGE, context: Path = CONTEXT) -> str:
    """`front-<12 hex>` of the source and the Dockerfile: a new pin gets a new tag in the immutable repository."""
    dockerfile = (context / "Dockerfile").read_bytes()
    digest = hashlib.sha256(source.encode() + b"\0" + dockerfile).hexdigest()
    return f"front-{digest[:12]}"


@dataclass(frozen=True)
class RouterFrontImageArgs:
    """Where the copy goes, or the reference to run instead of making one."""

    repository_name: str
    # A digest-pinned reference from config (`image.router_front_reference`):
    # run it and copy nothing.
    reference: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


class RouterFrontImage(pulumi.ComponentResource):
    """The routers' front image in the stack's ECR, exported as `repository@sha256:...`.

    Made only when a stack renders a router. Like the serving image, it is
    not built during preview, and is pushed under an immutable tag named for
    what it copies (`front_tag`).
    """

    reference: pulumi.Output[str]

    def __init__(self, name: str, args: RouterFrontImageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:RouterFrontImage", name, None, opts)
        if args.reference is not None:
            self.reference = pulumi.Output.from_input(args.reference)
            self.register_outputs({"reference": self.reference})
            return
        repository = image_repository(name, args.repository_name, args.tags, self)
        if not versions.ROUTER_FRONT_PINNED:
            pulumi.log.warn(UNPINNED_SOURCE_WARNING, resource=self)
        tag = front_tag()
        image = docker_build.Image(
            name,
            context=docker_build.BuildContextArgs(location=str(CONTEXT)),
            dockerfile=docker_build.DockerfileArgs(location=str(CONTEXT / "Dockerfile")),
            build_args={"BASE_IMAGE": versions.ROUTER_FRONT_IMAGE},
            platforms=[docker_build.Platform.LINUX_AMD64],
            tags=[repository.repository_url.apply(lambda url: f"{url}:{tag}")],
            push=True,
            build_on_preview=False,
            registries=[push_credentials(repository)],
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.reference = pulumi.Output.all(repository.repository_url, image.digest).apply(lambda a: f"{a[0]}@{a[1]}")
        self.register_outputs({"reference": self.reference, "tag": tag})
