#!/usr/bin/env bash
# Re-resolves the serving image's base tag (infra/versions.py RAY_LLM_BASE_TAG)
# to the digest the registry serves for it now and writes that digest into
# infra/versions.py (RAY_LLM_BASE_DIGEST) and the Dockerfile's BASE_IMAGE
# default, which a test keeps equal. Run where the registry is reachable
# (`make pin-base`), then review and commit the diff it prints: nothing else
# moves the base.
#
# The digest is the one of what the tag names (for ray-llm a multi-platform
# index); the build asks for linux/amd64 from it. Tools, in order: crane,
# docker buildx imagetools, or the registry's HTTP API with curl.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-venv/bin/python}
[ -x "$python" ] || python=python3
tag_ref=$("$python" -c 'from infra import versions; print(versions.RAY_LLM_BASE_TAG)')
repo=${tag_ref%:*}
tag=${tag_ref##*:}

resolve_with_curl() {
    # Docker Hub: an anonymous pull token, then HEAD on the manifest; the
    # registry names the digest in Docker-Content-Digest.
    local token accept
    token=$(curl -fsSL "https://auth.docker.io/token?service=registry.docker.io&scope=repository:${repo}:pull" |
        "$python" -c 'import json, sys; print(json.load(sys.stdin)["token"])')
    accept="application/vnd.oci.image.index.v1+json,application/vnd.docker.distribution.manifest.list.v2+json"
    accept+=",application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json"
    curl -fsSI -H "Authorization: Bearer ${token}" -H "Accept: ${accept}" \
        "https://registry-1.docker.io/v2/${repo}/manifests/${tag}" |
        tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" { print $2 }'
}

if command -v crane >/dev/null; then
    digest=$(crane digest "$tag_ref")
elif docker buildx version >/dev/null 2>&1; then
    digest=$(docker buildx imagetools inspect "$tag_ref" --format '{{ .Manifest.Digest }}')
else
    digest=$(resolve_with_curl)
fi

if ! [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "could not resolve ${tag_ref} to a digest (got '${digest}')" >&2
    exit 1
fi

sed -i -E "s|^RAY_LLM_BASE_DIGEST = \"sha256:[0-9a-f]{64}\"$|RAY_LLM_BASE_DIGEST = \"${digest}\"|" infra/versions.py
sed -i -E "s|^ARG BASE_IMAGE=.*$|ARG BASE_IMAGE=${tag_ref}@${digest}|" workloads/Dockerfile

pinned=$("$python" -c 'from infra import versions; print(versions.RAY_LLM_BASE_IMAGE)')
if [ "$pinned" != "${tag_ref}@${digest}" ]; then
    echo "infra/versions.py was not rewritten: RAY_LLM_BASE_DIGEST is no longer a plain sha256 line" >&2
    exit 1
fi
echo "${tag_ref} -> ${digest}"
git --no-pager diff -- infra/versions.py workloads/Dockerfile
