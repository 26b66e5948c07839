#!/usr/bin/env bash
# Fetches the reference data the tests check the program against: the
# values.yaml, Chart.yaml and CRDs of every chart pinned in infra/versions.py,
# at exactly the pinned versions.
#
#   scripts/fetch-reference.sh          fetch into $LLM_PLATFORM_REFERENCE
#                                       (default: ../shared/reference beside the repo)
#   scripts/fetch-reference.sh --raw    take every file from the upstream git tags,
#                                       even where helm is installed
#   scripts/fetch-reference.sh --list   print "<relative path> <url>" per file, fetch nothing
#   scripts/fetch-reference.sh --upstream       fetch the cited upstream files the shared
#                                       folder lacks into $LLM_PLATFORM_UPSTREAM
#                                       (default: build/upstream in the repo)
#   scripts/fetch-reference.sh --list-upstream  print those, fetch nothing
#
# With helm installed, a chart's own files come from `helm pull --untar` of
# the published chart; without it (or with --raw), from the chart sources at
# the upstream release tag on raw.githubusercontent.com. Files that are not
# part of a published chart always come from their upstream tag. Versions are
# read from infra/versions.py, never written here. Every run replaces the
# files it fetches and leaves any other file in the folder alone; a failed
# download stops the run before anything is replaced.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() {
  echo "fetch-reference: $*" >&2
  exit 1
}

mode=fetch
via=auto
for arg in "$@"; do
  case $arg in
    --list) mode=list ;;
    --upstream) mode=upstream ;;
    --list-upstream) mode=list-upstream ;;
    --raw) via=raw ;;
    -h | --help)
      sed -n '2,18s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    *) die "unknown argument: $arg (try --help)" ;;
  esac
done

python=${PYTHON:-}
if [ -z "$python" ]; then
  python=python3
  [ -x "$root/venv/bin/python" ] && python=$root/venv/bin/python
fi

# "<chart> <version> <repository>" per pinned chart.
pins=$(cd "$root" && "$python" -c '
from infra.versions import HELM_CHARTS
for c in HELM_CHARTS:
    print(c.chart, c.version, c.repository)
') || die "could not read the pinned versions from infra/versions.py with $python"
prometheus_operator=$(cd "$root" && "$python" -c '
from infra.versions import UPSTREAM_SOURCES
print(UPSTREAM_SOURCES["prometheus-operator"])
') || die "could not read the Prometheus Operator source tag from infra/versions.py with $python"

# pin CHART FIELD: a pinned chart's version or repository.
pin() {
  local field
  case $2 in
    version) field=2 ;;
    repository) field=3 ;;
    *) die "pin: unknown field $2" ;;
  esac
  awk -v chart="$1" -v field="$field" '$1 == chart { print $field; found = 1 } END { exit !found }' <<<"$pins" ||
    die "infra/versions.py pins no chart named $1"
}

# Release tags: each upstream names its tags after the chart version its own way.
gpu_operator=$(pin gpu-operator version)             # NVIDIA/gpu-operator: the version is the tag
kuberay=v$(pin kuberay-operator version)             # ray-project/kuberay: v<version>
kube_prometheus_stack=kube-prometheus-stack-$(pin kube-prometheus-stack version)
keda=v$(pin keda version)                            # kedacore/charts and kedacore/keda: v<version>
cluster_autoscaler=cluster-autoscaler-chart-$(pin cluster-autoscaler version)
# aws/eks-charts syncs this chart from kubernetes-sigs/aws-load-balancer-controller
# and tags only the whole repository; since 3.0 the chart and the controller
# share one version, which the controller's repository tags v<version>.
aws_load_balancer_controller=v$(pin aws-load-balancer-controller version)
external_dns=external-dns-helm-chart-$(pin external-dns version) # kubernetes-sigs/external-dns: chart releases
karpenter=v$(pin karpenter version)                  # aws/karpenter-provider-aws: v<version>

raw() { # ORG/REPO TAG PATH
  echo "https://raw.githubusercontent.com/$1/$2/$3"
}

# One line per file: <relative path> <chart or -> <path in the published chart or -> <url> <filter>.
# The src-<tag> folders hold upstream controllers' own code, read by the
# mirrors that port their behaviour (twin/kuberay.py cites them line by line).
# The chart column names the chart whose `helm pull` holds the file; "-" means
# the file is not in a published chart and always comes from <url>.
# Filter "helm-template" drops the Helm template lines of a CRD kept in templates/.
files="
gpu-operator/chart-values.yaml gpu-operator values.yaml $(raw NVIDIA/gpu-operator "$gpu_operator" deployments/gpu-operator/values.yaml) -
gpu-operator/chart.yaml gpu-operator Chart.yaml $(raw NVIDIA/gpu-operator "$gpu_operator" deployments/gpu-operator/Chart.yaml) -
kuberay/operator-chart-values.yaml kuberay-operator values.yaml $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/values.yaml) -
kuberay/operator-chart.yaml kuberay-operator Chart.yaml $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/Chart.yaml) -
kuberay/crd-rayservices.yaml kuberay-operator crds/ray.io_rayservices.yaml $(raw ray-project/kuberay "$kuberay" ray-operator/config/crd/bases/ray.io_rayservices.yaml) -
kuberay/crd-rayclusters.yaml kuberay-operator crds/ray.io_rayclusters.yaml $(raw ray-project/kuberay "$kuberay" ray-operator/config/crd/bases/ray.io_rayclusters.yaml) -
kube-prometheus-stack/chart-values.yaml kube-prometheus-stack values.yaml $(raw prometheus-community/helm-charts "$kube_prometheus_stack" charts/kube-prometheus-stack/values.yaml) -
kube-prometheus-stack/chart-chart.yaml kube-prometheus-stack Chart.yaml $(raw prometheus-community/helm-charts "$kube_prometheus_stack" charts/kube-prometheus-stack/Chart.yaml) -
kube-prometheus-stack/crd-prometheusrules.yaml kube-prometheus-stack charts/crds/crds/crd-prometheusrules.yaml $(raw prometheus-community/helm-charts "$kube_prometheus_stack" charts/kube-prometheus-stack/charts/crds/crds/crd-prometheusrules.yaml) -
kube-prometheus-stack/crd-servicemonitors.yaml kube-prometheus-stack charts/crds/crds/crd-servicemonitors.yaml $(raw prometheus-community/helm-charts "$kube_prometheus_stack" charts/kube-prometheus-stack/charts/crds/crds/crd-servicemonitors.yaml) -
kube-prometheus-stack/crd-podmonitors.yaml kube-prometheus-stack charts/crds/crds/crd-podmonitors.yaml $(raw prometheus-community/helm-charts "$kube_prometheus_stack" charts/kube-prometheus-stack/charts/crds/crds/crd-podmonitors.yaml) -
keda/chart-values.yaml keda values.yaml $(raw kedacore/charts "$keda" keda/values.yaml) -
keda/chart-chart.yaml keda Chart.yaml $(raw kedacore/charts "$keda" keda/Chart.yaml) -
keda/crd-scaledobjects.yaml keda templates/crds/crd-scaledobjects.yaml $(raw kedacore/charts "$keda" keda/templates/crds/crd-scaledobjects.yaml) helm-template
keda/crd-triggerauthentications.yaml - - $(raw kedacore/keda "$keda" config/crd/bases/keda.sh_triggerauthentications.yaml) -
keda/crd-clustertriggerauthentications.yaml - - $(raw kedacore/keda "$keda" config/crd/bases/keda.sh_clustertriggerauthentications.yaml) -
cluster-autoscaler/chart-values.yaml cluster-autoscaler values.yaml $(raw kubernetes/autoscaler "$cluster_autoscaler" cluster-autoscaler/charts/cluster-autoscaler/values.yaml) -
cluster-autoscaler/chart-chart.yaml cluster-autoscaler Chart.yaml $(raw kubernetes/autoscaler "$cluster_autoscaler" cluster-autoscaler/charts/cluster-autoscaler/Chart.yaml) -
aws-load-balancer-controller/chart-values.yaml aws-load-balancer-controller values.yaml $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" helm/aws-load-balancer-controller/values.yaml) -
aws-load-balancer-controller/chart-chart.yaml aws-load-balancer-controller Chart.yaml $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" helm/aws-load-balancer-controller/Chart.yaml) -
external-dns/chart-values.yaml external-dns values.yaml $(raw kubernetes-sigs/external-dns "$external_dns" charts/external-dns/values.yaml) -
external-dns/Chart.yaml external-dns Chart.yaml $(raw kubernetes-sigs/external-dns "$external_dns" charts/external-dns/Chart.yaml) -
karpenter/chart-values.yaml karpenter values.yaml $(raw aws/karpenter-provider-aws "$karpenter" charts/karpenter/values.yaml) -
karpenter/Chart.yaml karpenter Chart.yaml $(raw aws/karpenter-provider-aws "$karpenter" charts/karpenter/Chart.yaml) -
karpenter/crd-nodepools.yaml karpenter crds/karpenter.sh_nodepools.yaml $(raw aws/karpenter-provider-aws "$karpenter" pkg/apis/crds/karpenter.sh_nodepools.yaml) -
karpenter/crd-nodeclaims.yaml karpenter crds/karpenter.sh_nodeclaims.yaml $(raw aws/karpenter-provider-aws "$karpenter" pkg/apis/crds/karpenter.sh_nodeclaims.yaml) -
karpenter/crd-ec2nodeclasses.yaml karpenter crds/karpenter.k8s.aws_ec2nodeclasses.yaml $(raw aws/karpenter-provider-aws "$karpenter" pkg/apis/crds/karpenter.k8s.aws_ec2nodeclasses.yaml) -
karpenter/cloudformation.yaml - - $(raw aws/karpenter-provider-aws "$karpenter" website/content/en/preview/getting-started/getting-started-with-karpenter/cloudformation.yaml) -
kuberay/src-$kuberay/LICENSE - - $(raw ray-project/kuberay "$kuberay" LICENSE) -
kuberay/src-$kuberay/ray-operator/controllers/ray/raycluster_controller.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/raycluster_controller.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/rayservice_controller.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/rayservice_controller.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/networkpolicy_controller.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/networkpolicy_controller.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/common/association.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/common/association.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/common/job.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/common/job.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/common/pod.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/common/pod.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/common/service.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/common/service.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/utils/constant.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/utils/constant.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/utils/util.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/utils/util.go) -
kuberay/src-$kuberay/ray-operator/controllers/ray/utils/validation.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/utils/validation.go) -
aws-load-balancer-controller/src-$aws_load_balancer_controller/LICENSE - - $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" LICENSE) -
aws-load-balancer-controller/src-$aws_load_balancer_controller/pkg/inject/pod_readiness/pod_readiness_gate.go - - $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" pkg/inject/pod_readiness/pod_readiness_gate.go) -
aws-load-balancer-controller/src-$aws_load_balancer_controller/webhooks/core/pod_readiness_gate_mutator.go - - $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" webhooks/core/pod_readiness_gate_mutator.go) -
aws-load-balancer-controller/src-$aws_load_balancer_controller/webhooks/core/service_mutator.go - - $(raw kubernetes-sigs/aws-load-balancer-controller "$aws_load_balancer_controller" webhooks/core/service_mutator.go) -
prometheus-operator/src-$prometheus_operator/LICENSE - - $(raw prometheus-operator/prometheus-operator "$prometheus_operator" LICENSE) -
prometheus-operator/src-$prometheus_operator/pkg/prometheus/promcfg.go - - $(raw prometheus-operator/prometheus-operator "$prometheus_operator" pkg/prometheus/promcfg.go) -
"
# Upstream files the mirrors also cite that the shared reference folder does
# not hold (the operator's metrics code and its chart's templates). `--upstream`
# fetches them into $LLM_PLATFORM_UPSTREAM (default build/upstream in the repo),
# where tests/twin/test_kuberay_citations.py checks the lines cited from them.
upstream_files="
kuberay/src-$kuberay/ray-operator/controllers/ray/metrics/ray_service_metrics.go - - $(raw ray-project/kuberay "$kuberay" ray-operator/controllers/ray/metrics/ray_service_metrics.go) -
kuberay/src-$kuberay/helm-chart/kuberay-operator/templates/_helpers.tpl - - $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/templates/_helpers.tpl) -
kuberay/src-$kuberay/helm-chart/kuberay-operator/templates/deployment.yaml - - $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/templates/deployment.yaml) -
kuberay/src-$kuberay/helm-chart/kuberay-operator/templates/service.yaml - - $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/templates/service.yaml) -
kuberay/src-$kuberay/helm-chart/kuberay-operator/templates/servicemonitor.yaml - - $(raw ray-project/kuberay "$kuberay" helm-chart/kuberay-operator/templates/servicemonitor.yaml) -
"
# The GPU Operator's Chart.yaml at a git tag carries a development version,
# so a note names the release the files belong to.
source_note=gpu-operator/SOURCE.txt
source_url=https://github.com/NVIDIA/gpu-operator/tree/$gpu_operator/deployments/gpu-operator

if [ "$mode" = list ] || [ "$mode" = list-upstream ]; then
  listing=$files
  [ "$mode" = list-upstream ] && listing=$upstream_files
  while read -r path _ _ url _; do
    [ -n "$path" ] && echo "$path $url"
  done <<<"$listing"
  [ "$mode" = list ] && echo "$source_note $source_url"
  exit 0
fi

dest=${LLM_PLATFORM_REFERENCE:-$root/../shared/reference}
if [ "$mode" = upstream ]; then
  files=$upstream_files
  dest=${LLM_PLATFORM_UPSTREAM:-$root/build/upstream}
  via=raw
fi
if [ "$via" = auto ]; then
  if command -v helm >/dev/null 2>&1; then via=helm; else via=raw; fi
fi
command -v curl >/dev/null 2>&1 || die "curl is required"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

download() { # URL OUT
  curl --fail --silent --show-error --location --retry 3 --retry-delay 2 --output "$2" "$1" ||
    die "download failed: $1"
  [ -s "$2" ] || die "downloaded an empty file: $1"
}

# pulled CHART: the folder of the published chart, pulled once per run.
pulled() {
  local into=$work/helm/$1
  if [ ! -d "$into/$1" ]; then
    mkdir -p "$into"
    local repo source
    repo=$(pin "$1" repository)
    # An OCI registry is addressed as oci://<registry>/<chart>, not with --repo.
    case $repo in oci://*) source=("$repo/$1") ;; *) source=("$1" --repo "$repo") ;; esac
    helm pull "${source[@]}" --version "$(pin "$1" version)" --untar --untardir "$into" >&2 ||
      die "helm pull of $1 $(pin "$1" version) failed (--raw takes the files from the upstream tag instead)"
  fi
  echo "$into/$1"
}

# Drops the template-only lines of a CRD kept in a chart's templates/ and
# fills in the one value it reads (the operator's name, from the chart's values).
strip_helm_template() { # IN OUT VALUES
  local operator_name
  operator_name=$(awk '/^operator:/ { inside = 1; next } inside && /^[^ #]/ { inside = 0 } inside && /^  name:/ { print $2; exit }' "$3")
  [ -n "$operator_name" ] || die "no operator.name in $3"
  sed -e '/^[[:space:]]*{{-.*}}[[:space:]]*$/d' -e "s/{{ \.Values\.operator\.name }}/$operator_name/" "$1" >"$2"
  if grep -n '{{' "$2" >&2; then
    die "Helm template lines left in $2: the chart's CRD template changed shape"
  fi
}

staged=$work/out
while read -r path chart chart_path url filter; do
  [ -n "$path" ] || continue
  mkdir -p "$staged/$(dirname "$path")"
  fetched=$work/fetched
  if [ "$via" = helm ] && [ "$chart" != - ]; then
    from=$(pulled "$chart")
    [ -s "$from/$chart_path" ] || die "$chart $(pin "$chart" version) has no $chart_path"
    cp "$from/$chart_path" "$fetched"
  else
    download "$url" "$fetched"
  fi
  if [ "$filter" = helm-template ]; then
    values=$staged/$(dirname "$path")/chart-values.yaml
    [ -s "$values" ] || die "$path needs $(dirname "$path")/chart-values.yaml fetched before it"
    strip_helm_template "$fetched" "$staged/$path" "$values"
  else
    mv "$fetched" "$staged/$path"
  fi
  echo "fetched $path" >&2
done <<<"$files"

if [ "$mode" = upstream ]; then
  :
elif [ "$via" = helm ]; then
  note="values.yaml and Chart.yaml taken from the published chart gpu-operator $gpu_operator ($(pin gpu-operator repository))"
else
  note="values.yaml and Chart.yaml taken at git tag $gpu_operator of NVIDIA/gpu-operator (chart published as $gpu_operator)"
fi
[ "$mode" = upstream ] || echo "# $note" >"$staged/$source_note"

# Every file arrived: only now replace the old copies.
(cd "$staged" && find . -type f) | while read -r file; do
  mkdir -p "$dest/$(dirname "$file")"
  mv -f "$staged/$file" "$dest/$file"
done
echo "reference data for the pinned charts is in $dest (via $via)" >&2
