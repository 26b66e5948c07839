#!/usr/bin/env bash
# The system packages a make target uses beside the venv, installed when missing.
#
#   scripts/system-deps.sh test    prometheus (promtool checks and unit-tests the
#                                  rules; the twin's Prometheus), shellcheck
#                                  (actionlint runs the workflows' scripts
#                                  through it), redis-server and openssl (the
#                                  GCS fault-tolerance test: Redis over TLS with
#                                  a CA it makes), nginx-light (the request
#                                  router's front, infra/serving/router_front.py)
#   scripts/system-deps.sh twin    prometheus (the twin's monitoring), nginx-light
#                                  (the router's front, in the routing check and
#                                  make bench / make whatif)
#
# As root with apt-get, the missing packages are installed; otherwise the
# script stops with one line naming them and the command that installs them.
set -euo pipefail

# package:command pairs: the package is missing when its command is not on PATH.
case ${1:-} in
  test) wanted="prometheus:prometheus prometheus:promtool shellcheck:shellcheck redis-server:redis-server openssl:openssl nginx-light:nginx" ;;
  twin) wanted="prometheus:prometheus nginx-light:nginx" ;;
  *)
    echo "usage: scripts/system-deps.sh test|twin" >&2
    exit 2
    ;;
esac

# Debian puts nginx in /usr/sbin, which a user's PATH may not hold.
PATH="$PATH:/usr/sbin"
missing=()
for pair in $wanted; do
  package=${pair%%:*}
  command=${pair#*:}
  if ! command -v "$command" >/dev/null 2>&1; then
    case " ${missing[*]} " in
      *" $package "*) ;;
      *) missing+=("$package") ;;
    esac
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  exit 0
fi
echo "missing system packages: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
exit 1
