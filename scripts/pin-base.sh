#!/usr/bin/env bash
# Re-resolves the tags of the images the program names by digest and writes
# each digest into infra/versions.py:
#   - the serving image's base (RAY_LLM_BASE_TAG -> RAY_LLM_BASE_DIGEST, and
#     the Dockerfile's BASE_IMAGE default, which a test keeps equal);
#   - the request router's front (ROUTER_FRONT_TAG -> ROUTER_FRONT_DIGEST, and
#     the BASE_IMAGE default of infra/aws/router_front/Dockerfile, which the
#     stack copies into its own registry).
# Run where the registries are reachable (`make pin-base`), then review and
# commit the diff it prints: nothing else moves them.
#
# Each digest is the one of what the tag names (a multi-platform index); the
# nodes pull linux/amd64 from it. Tools, in order: crane, docker buildx
# imagetools, or the registry's HTTP API with curl (Docker Hub, ECR Public).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-venv/bin/python}
[ -x "$python" ] || python=python3
version_of() { "$python" -c "from infra import versions; print(versions.$1)"; }

manifest_digest() {
    # HEAD on the manifest with a pull token; the registry names the digest in Docker-Content-Digest.
    local base=$1 repo=$2 tag=$3 token=$4 accept
    accept="application/vnd.oci.image.index.v1+json,application/vnd.docker.distribution.manifest.list.v2+json"
    accept+=",application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json"
    curl -fsSI -H "Authorization: Bearer ${token}" -H "Accept: ${accept}" "${base}/v2/${repo}/manifests/${tag}" |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }'
}

resolve_with_curl() {
    local ref=$1 name tag token
    name=${ref%:*}
    tag=${ref##*:}
    case $name in
        public.ecr.aws/*)
            name=${name#public.ecr.aws/}
            token=$(curl -fsSL "https://public.ecr.aws/token/?scope=repository:${name}:pull" |
                "$python" -c 'import json, sys; print(json.load(sys.stdin)["token"])')
            manifest_digest "https://public.ecr.aws" "$name" "$tag" "$token"
            ;;
        *)
            token=$(curl -fsSL "https://auth.docker.io/token?service=registry.docker.io&scope=repository:${name}:pull" |
                "$python" -c 'import json, sys; print(json.load(sys.stdin)["token"])')
            manifest_digest "https://registry-1.docker.io" "$name" "$tag" "$token"
            ;;
    esac
}

resolve() {
    local ref=$1 digest
    if command -v crane >/dev/null; then
        digest=$(crane digest "$ref")
    elif docker buildx version >/dev/null 2>&1; then
        digest=$(docker buildx imagetools inspect "$ref" --format '{{ .Manifest.Digest }}')
    else
        digest=$(resolve_with_curl "$ref")
    fi
    if ! [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]]; then
        echo "could not resolve ${ref} to a digest (got '${digest}')" >&2
        exit 1
    fi
    echo "$digest"
}

# pin <tag constant> <digest constant> <image constant>: resolve, rewrite, check.
pin() {
    local ref digest
    ref=$(version_of "$1")
    digest=$(resolve "$ref")
    sed -i -E "s|^$2 = \"sha256:[0-9a-f]{64}\"$|$2 = \"${digest}\"|" infra/versions.py
    if [ "$(version_of "$3")" != "${ref}@${digest}" ]; then
        echo "infra/versions.py was not rewritten: $2 is no longer a plain sha256 line" >&2
        exit 1
    fi
    echo "${ref} -> ${digest}"
}

pin RAY_LLM_BASE_TAG RAY_LLM_BASE_DIGEST RAY_LLM_BASE_IMAGE
sed -i -E "s|^ARG BASE_IMAGE=.*$|ARG BASE_IMAGE=$(version_of RAY_LLM_BASE_IMAGE)|" workloads/Dockerfile
pin ROUTER_FRONT_TAG ROUTER_FRONT_DIGEST ROUTER_FRONT_IMAGE
sed -i -E "s|^ARG BASE_IMAGE=.*$|ARG BASE_IMAGE=$(version_of ROUTER_FRONT_IMAGE)|" infra/aws/router_front/Dockerfile
git --no-pager diff -- infra/versions.py workloads/Dockerfile infra/aws/router_front/Dockerfile
