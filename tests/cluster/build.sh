#!/usr/bin/env bash
# Builds the control-plane binaries the tests run (kube-apiserver, kube-scheduler,
# kube-controller-manager, etcd, helm, kwok) from their Go modules at the versions pinned in
# versions.env, into a cache directory keyed by those pins. Builds only what is missing;
# concurrent callers wait on a lock instead of building twice. Prints the binary directory last.
#
#   tests/cluster/build.sh                   # everything
#   tests/cluster/build.sh etcd kube-apiserver
#   tests/cluster/build.sh --print-dir       # only print where the binaries go
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
tools="$here/tools"
all=(etcd kube-apiserver kube-scheduler kube-controller-manager helm kwok)

die() { echo "build.sh: $*" >&2; exit 1; }

key_files=("$here/versions.env" "$tools/kubernetes/go.mod" "$tools/kubernetes/go.sum"
           "$tools/etcd/go.mod" "$tools/etcd/go.sum" "$tools/etcd/main.go")
key="$(cat "${key_files[@]}" | sha256sum | cut -c1-12)"
cache_root="${IWG_CACHE_DIR:-$HOME/.cache/iwg}"
bin_dir="$cache_root/bin-$key"

if [[ "${1:-}" == "--print-dir" ]]; then
  echo "$bin_dir"
  exit 0
fi

wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=("${all[@]}")
for name in "${wanted[@]}"; do
  [[ " ${all[*]} " == *" $name "* ]] || die "unknown binary '$name' (known: ${all[*]})"
done

command -v go >/dev/null || die "the go command is needed to build the control plane (https://go.dev/dl)"
grep -q "k8s.io/kubernetes $KUBERNETES_VERSION" "$tools/kubernetes/go.mod" \
  || die "tools/kubernetes/go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION (versions.env)"
grep -q "go.etcd.io/etcd/server/v3 $ETCD_VERSION" "$tools/etcd/go.mod" \
  || die "tools/etcd/go.mod does not require go.etcd.io/etcd/server/v3 $ETCD_VERSION (versions.env)"

mkdir -p "$bin_dir/logs"
exec 9>"$bin_dir/.lock"
if ! flock -n 9; then
  echo "build.sh: another build into $bin_dir is running; waiting for it" >&2
  flock 9
fi

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
cv=k8s.io/component-base/version
k8s_ldflags="-s -w -X $cv.gitVersion=$KUBERNETES_VERSION -X $cv.gitMajor=1 -X $cv.gitMinor=$k8s_minor"
k8s_ldflags+=" -X $cv.gitTreeState=clean -X $cv.buildDate=1970-01-01T00:00:00Z"

# Each build writes to a temporary name and renames it, so an interrupted build never leaves a
# binary that looks complete.
build_one() {
  local name="$1" out="$bin_dir/.$1.partial"
  case "$name" in
    kube-apiserver | kube-scheduler | kube-controller-manager)
      (cd "$tools/kubernetes" && go build -ldflags "$k8s_ldflags" -o "$out" "k8s.io/kubernetes/cmd/$name") ;;
    etcd)
      (cd "$tools/etcd" && go build -ldflags "-s -w" -o "$out" .) ;;
    helm)
      local gobin; gobin="$(mktemp -d "$bin_dir/.gobin.XXXXXX")"
      GOBIN="$gobin" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
      mv "$gobin/helm" "$out" && rmdir "$gobin" ;;
    kwok)
      local gobin; gobin="$(mktemp -d "$bin_dir/.gobin.XXXXXX")"
      GOTOOLCHAIN="$KWOK_GOTOOLCHAIN" GOBIN="$gobin" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
      mv "$gobin/kwok" "$out" && rmdir "$gobin" ;;
  esac
  mv "$out" "$bin_dir/$name"
}

# CPU seconds used so far by this script's finished children (go and its compilers): the
# cutime and cstime fields of /proc/<this shell>/stat. Unlike wall time, it does not grow when
# other work shares the machine.
clk_tck="$(getconf CLK_TCK)"
children_cpu() {
  awk -v tck="$clk_tck" '{ sub(/^.*\) /, ""); printf "%d", ($14 + $15) / tck }' "/proc/$$/stat"
}

total_start=$SECONDS
built=0
for name in "${wanted[@]}"; do
  if [[ -x "$bin_dir/$name" ]]; then
    echo "build.sh: $name cached"
    continue
  fi
  log="$bin_dir/logs/$name.log"
  echo "build.sh: building $name (log: $log)"
  start=$SECONDS
  cpu_start="$(children_cpu)"
  if ! build_one "$name" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "building $name failed; full log: $log"
  fi
  secs=$((SECONDS - start))
  cpu=$(($(children_cpu) - cpu_start))
  built=$((built + 1))
  echo "$(date -u +%FT%TZ) $name built in ${secs}s (${cpu} CPU-s, $(nproc) cores)" >>"$bin_dir/logs/times.log"
  echo "build.sh: $name built in ${secs}s (${cpu} CPU-seconds)"
done
echo "build.sh: ${#wanted[@]} binaries ready ($built built) in $((SECONDS - total_start))s, $(children_cpu) CPU-seconds: $bin_dir"
