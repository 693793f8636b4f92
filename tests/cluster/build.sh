#!/usr/bin/env bash
# Builds the binaries the tests run (kube-apiserver, kube-scheduler, kube-controller-manager, etcd, the
# real nodes' kubelet, kube-proxy, CoreDNS and simulated-GPU device plugin, helm, kwok, kube-score) from
# their Go modules at the versions pinned in versions.env (the device plugin is ours: tools/deviceplugin).
# Each binary is cached under a key of its own recipe (module, version, link flags, toolchain, tools
# module files), so changing one pin rebuilds that binary alone. Builds only what is
# missing; concurrent callers wait on a lock per binary instead of building twice. Prints the binary directory last.
#
#   tests/cluster/build.sh                   # everything
#   tests/cluster/build.sh etcd kube-apiserver
#   tests/cluster/build.sh --print-dir       # only print where the binaries are found
#   tests/cluster/build.sh --print-keys      # each binary's cache key
#   tests/cluster/build.sh --find-earlier NAME   # an earlier cache directory's NAME this recipe built
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
tools="$here/tools"
all=(etcd kube-apiserver kube-scheduler kube-controller-manager kubelet kube-proxy coredns helm kwok kube-score
  deviceplugin)

die() { echo "build.sh: $*" >&2; exit 1; }

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
cv=k8s.io/component-base/version
k8s_ldflags="-s -w -X $cv.gitVersion=$KUBERNETES_VERSION -X $cv.gitMajor=1 -X $cv.gitMinor=$k8s_minor"
k8s_ldflags+=" -X $cv.gitTreeState=clean -X $cv.buildDate=1970-01-01T00:00:00Z"
# helm's default Kubernetes version (what `helm template` and `helm lint` assume without --kube-version) is
# set at link time, as helm's own Makefile does; unset it is v1.20, below the chart's kubeVersion. It is
# set to the Kubernetes version the tests run.
hv=helm.sh/helm/v3
helm_ldflags="-s -w -X $hv/internal/version.version=$HELM_VERSION -X $hv/internal/version.gitTreeState=clean"
helm_ldflags+=" -X $hv/pkg/chartutil.k8sVersionMajor=1 -X $hv/pkg/chartutil.k8sVersionMinor=$k8s_minor"
helm_ldflags+=" -X $hv/pkg/lint/rules.k8sVersionMajor=1 -X $hv/pkg/lint/rules.k8sVersionMinor=$k8s_minor"

# Per binary: the pinned module and version, the package built, the link flags, a tools module (a
# directory under tools/ built with `go build`; none: `go install package@version`) and the Go toolchain
# (empty: the machine's).
declare -A module version package ldflags tooldir toolchain
for name in kube-apiserver kube-scheduler kube-controller-manager kubelet kube-proxy; do
  module[$name]=k8s.io/kubernetes version[$name]=$KUBERNETES_VERSION package[$name]=k8s.io/kubernetes/cmd/$name
  ldflags[$name]=$k8s_ldflags tooldir[$name]=kubernetes toolchain[$name]=""
done
module[etcd]=go.etcd.io/etcd/server/v3 version[etcd]=$ETCD_VERSION package[etcd]=.
ldflags[etcd]="-s -w" tooldir[etcd]=etcd toolchain[etcd]=""
module[helm]=$hv version[helm]=$HELM_VERSION package[helm]=$hv/cmd/helm
ldflags[helm]=$helm_ldflags tooldir[helm]="" toolchain[helm]=""
module[kwok]=sigs.k8s.io/kwok version[kwok]=$KWOK_VERSION package[kwok]=sigs.k8s.io/kwok/cmd/kwok
ldflags[kwok]="-s -w" tooldir[kwok]="" toolchain[kwok]=$KWOK_GOTOOLCHAIN
module[coredns]=github.com/coredns/coredns version[coredns]=$COREDNS_VERSION package[coredns]=github.com/coredns/coredns
ldflags[coredns]="-s -w" tooldir[coredns]="" toolchain[coredns]=""
module[kube-score]=github.com/zegl/kube-score version[kube-score]=$KUBE_SCORE_VERSION
package[kube-score]=github.com/zegl/kube-score/cmd/kube-score
ldflags[kube-score]="-s -w -X main.version=$KUBE_SCORE_VERSION" tooldir[kube-score]="" toolchain[kube-score]=""
module[deviceplugin]=iwg.dev/tools/deviceplugin version[deviceplugin]="(devel)" package[deviceplugin]=.
ldflags[deviceplugin]="-s -w" tooldir[deviceplugin]=deviceplugin toolchain[deviceplugin]=""

# A binary's cache key: its recipe and the files of its tools module, nothing of the other binaries.
key_of() {
  local name="$1"
  {
    printf '%s\n' "$name" "${module[$name]}" "${version[$name]}" "${package[$name]}" \
      "${ldflags[$name]}" "${tooldir[$name]}" "${toolchain[$name]}"
    if [[ -n "${tooldir[$name]}" ]]; then
      find "$tools/${tooldir[$name]}" -type f | LC_ALL=C sort | xargs cat
    fi
  } | sha256sum | cut -c1-12
}

cache_root="${IWG_CACHE_DIR:-$HOME/.cache/iwg}"
# store/<name>-<key>/<name> holds the binaries; bin-<hash of all keys>/ links each name to its store entry
# (the one directory the tests look in), so a directory never mixes pin sets.
store="$cache_root/store"
declare -A key
for name in "${all[@]}"; do key[$name]="$(key_of "$name")"; done
bin_dir="$cache_root/bin-$(for name in "${all[@]}"; do echo "$name ${key[$name]}"; done | sha256sum | cut -c1-12)"

case "${1:-}" in
  --print-dir) echo "$bin_dir"; exit 0 ;;
  --print-keys) for name in "${all[@]}"; do echo "$name ${key[$name]}"; done; exit 0 ;;
esac

# Whether a binary was built by this recipe, read from the build information Go embeds in it: the same
# toolchain, the pinned module at its version, the same link flags and, for a tools module, dependencies
# whose sums are all in that module's go.sum. Lets binaries built before the per-binary cache (under
# bin-<hash of all pins>/) be taken over instead of rebuilt.
built_by_recipe() {
  local name="$1" file="$2" info go_version
  info="$(go version -m "$file" 2>/dev/null)" || return 1
  go_version="${toolchain[$name]:-$(go env GOVERSION)}"
  [[ "$(head -n 1 <<<"$info")" == "$file: $go_version" ]] || return 1
  grep -qxF "	build	-ldflags=\"${ldflags[$name]}\"" <<<"$info" || return 1
  awk -F'\t' -v m="${module[$name]}" -v v="${version[$name]}" \
    '($2 == "mod" || $2 == "dep" || $2 == "=>") && $3 == m && $4 == v { found = 1 } END { exit !found }' \
    <<<"$info" || return 1
  if [[ -n "${tooldir[$name]}" ]]; then
    awk -F'\t' '($2 == "dep" || $2 == "=>") && $5 != "" { print $3 " " $4 " " $5 }' <<<"$info" \
      | grep -vxF -f "$tools/${tooldir[$name]}/go.sum" | grep -q . && return 1
  fi
  return 0
}

# Each build writes to a temporary name and renames it, so an interrupted build never leaves a
# binary that looks complete.
build_one() {
  local name="$1" out="$2"
  if [[ -n "${tooldir[$name]}" ]]; then
    (cd "$tools/${tooldir[$name]}" && go build -ldflags "${ldflags[$name]}" -o "$out" "${package[$name]}")
  else
    local gobin; gobin="$(mktemp -d "$(dirname "$out")/.gobin.XXXXXX")"
    GOTOOLCHAIN="${toolchain[$name]:-${GOTOOLCHAIN:-}}" GOBIN="$gobin" \
      go install -ldflags "${ldflags[$name]}" "${package[$name]}@${version[$name]}"
    mv "$gobin/$(basename "${package[$name]}")" "$out" && rmdir "$gobin"
  fi
}

# A binary of an earlier cache directory (not a link) or of an earlier store entry (another key: its tools
# module has changed, say go.sum lines added for another binary) that this recipe would have built, if any.
earlier_build() {
  local name="$1" candidate
  # Our own module (the device plugin): its build information names no version of its source, so a build
  # of other source would look like this recipe's. Never taken over: it builds in seconds.
  [[ "${module[$name]}" == iwg.dev/* ]] && return 1
  for candidate in "$cache_root"/bin-*/"$name" "$store/$name"-*/"$name"; do
    [[ -f "$candidate" && ! -L "$candidate" && -x "$candidate" ]] || continue
    if built_by_recipe "$name" "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [[ "${1:-}" == "--find-earlier" ]]; then
  [[ " ${all[*]} " == *" ${2:-} "* ]] || die "--find-earlier needs a binary name (known: ${all[*]})"
  earlier_build "$2"
  exit
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

mkdir -p "$bin_dir/logs" "$store"

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
  entry="$store/$name-${key[$name]}"
  mkdir -p "$entry"
  exec 9>"$entry/.lock"
  if ! flock -n 9; then
    echo "build.sh: another build of $name into $entry is running; waiting for it" >&2
    flock 9
  fi
  if [[ -x "$entry/$name" ]]; then
    echo "build.sh: $name cached"
  elif earlier="$(earlier_build "$name")"; then
    ln -f "$earlier" "$entry/.$name.partial" 2>/dev/null || cp "$earlier" "$entry/.$name.partial"
    mv "$entry/.$name.partial" "$entry/$name"
    echo "build.sh: $name taken over from $earlier (same recipe)"
  else
    log="$bin_dir/logs/$name.log"
    echo "build.sh: building $name (log: $log)"
    start=$SECONDS
    cpu_start="$(children_cpu)"
    if ! build_one "$name" "$entry/.$name.partial" >"$log" 2>&1; then
      tail -n 30 "$log" >&2
      die "building $name failed; full log: $log"
    fi
    mv "$entry/.$name.partial" "$entry/$name"
    secs=$((SECONDS - start))
    cpu=$(($(children_cpu) - cpu_start))
    built=$((built + 1))
    echo "$(date -u +%FT%TZ) $name built in ${secs}s (${cpu} CPU-s, $(nproc) cores)" >>"$bin_dir/logs/times.log"
    echo "build.sh: $name built in ${secs}s (${cpu} CPU-seconds)"
  fi
  exec 9>&-
  ln -sfn "$entry/$name" "$bin_dir/$name"
done
echo "build.sh: ${#wanted[@]} binaries ready ($built built) in $((SECONDS - total_start))s, $(children_cpu) CPU-seconds: $bin_dir"
