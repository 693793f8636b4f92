#!/usr/bin/env bash
# Builds the two images the real nodes run, as docker archives `ctr images import` reads, cached under a
# key of their recipe (this script, pause.c, the Debian suite and packages):
#   pause.tar   iwg.local/pause:1            the pod sandbox: pause.c, linked statically
#   worker.tar  iwg.local/iwg-worker-light:1 Debian bookworm minbase and the shared libraries the test
#               environment's Python needs. Python itself, the virtual environment and the repository are
#               NOT in the image: the nodes bind-mount them read-only at the same paths (tests/realnodes/node.py).
# Prints the directory holding both archives.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
suite=bookworm
packages=(libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libexpat1 libuuid1 libncursesw6
  libreadline8 libstdc++6 libgomp1 libnuma1 ca-certificates)
key="$({ cat "$here/image.sh" "$here/pause.c"; echo "$suite ${packages[*]}"; } | sha256sum | cut -c1-12)"
out="${IWG_CACHE_DIR:-$HOME/.cache/iwg}/images/realnodes-$key"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$out"; exit 0; fi
[[ -f "$out/worker.tar" && -f "$out/pause.tar" ]] && { echo "$out"; exit 0; }

mkdir -p "$out"
exec 9>"$out/.lock"
flock 9
[[ -f "$out/worker.tar" && -f "$out/pause.tar" ]] && { echo "$out"; exit 0; }
work="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# An OCI layout of one layer (a tar of a root filesystem) with the given config, as a docker archive.
archive() {
  local layer="$1" name="$2" dest="$3"; shift 3
  umoci init --layout "$work/oci-$dest"
  umoci new --image "$work/oci-$dest:img"
  umoci raw add-layer --image "$work/oci-$dest:img" "$layer"
  umoci config --image "$work/oci-$dest:img" "$@"
  skopeo --insecure-policy copy -q "oci:$work/oci-$dest:img" "docker-archive:$work/$dest:$name"
  mv "$work/$dest" "$out/$dest"
}

started=$SECONDS
mkdir -p "$work/pause-root"
gcc -static -Os -s -o "$work/pause-root/pause" "$here/pause.c"
tar -C "$work/pause-root" -cf "$work/pause-layer.tar" .
archive "$work/pause-layer.tar" iwg.local/pause:1 pause.tar --config.entrypoint /pause

# /root is made traversable so that a bind mount under it (the test environment's Python) is reachable by
# the pods' unprivileged user; nothing else is in it.
mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
  --customize-hook='chmod 755 "$1/root"' --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
  "$suite" "$work/worker-layer.tar"
# No PATH in the image's config: an image's PATH would replace the base runtime spec's, which puts the
# bind-mounted test environment's commands first.
# No user either: the image runs as root unless the pod's securityContext says otherwise, so a test sees
# the user the operator asks for, not the image's.
archive "$work/worker-layer.tar" iwg.local/iwg-worker-light:1 worker.tar --clear=config.entrypoint
echo "image.sh: images built in $((SECONDS - started))s: $(du -sh "$out/worker.tar" | cut -f1) (worker), $(du -sh "$out/pause.tar" | cut -f1) (pause)" >&2
echo "$out"
