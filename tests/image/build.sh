#!/usr/bin/env bash
# Builds the worker image from worker_image/Dockerfile, unchanged, with buildah (no Docker daemon, no registry),
# and saves it as a docker archive `ctr images import` reads. Prints the archive's path; cached under a key
# of everything that shapes the image (the Dockerfile, .dockerignore, the packaging files, the operator and
# worker sources, this script, the base's recipe).
#
# The Dockerfile's FROM is its TORCH_IMAGE argument (a pytorch/pytorch image on a registry this machine
# cannot reach). The base given here is made locally: Debian bookworm minbase with its python3 (3.11) and a
# virtual environment at /opt/venv holding the test environment's torch (PyPI's build: CUDA 13 and CPU),
# first on PATH. Both steps reach PyPI; a host behind a TLS-inspecting proxy gives its CA bundle and pip.conf
# to the build's RUN steps (mounted read-only, not copied into the image).
#
# Storage lives under the cache directory (buildah's --root/--runroot), nothing under /var/lib. Needs root,
# buildah, mmdebstrap (make image-test installs them).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="$root/.venv/bin/python"
suite=bookworm
torch_version="$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
name=iwg.local/iwg-worker:dev
cache="${IWG_CACHE_DIR:-$HOME/.cache/iwg}"
base_recipe=1  # raise it when the base's recipe below changes
base_key="$(echo "$base_recipe $suite $torch_version" | sha256sum | cut -c1-12)"
base="iwg.local/torch-base:$base_key"
key="$(cd "$root" && { cat "$here/build.sh" worker_image/Dockerfile .dockerignore pyproject.toml README.md;
  git ls-files -z operator/iwg_operator worker_image/iwg_worker | xargs -0 cat; echo "$base"; } | sha256sum | cut -c1-12)"
out="$cache/images/worker-$key"
if [[ "${1:-}" == "--print" ]]; then echo "$out/iwg-worker.tar"; exit 0; fi
[[ -f "$out/iwg-worker.tar" ]] && { echo "$out/iwg-worker.tar"; exit 0; }

mkdir -p "$out" "$cache/buildah"
exec 9>"$cache/buildah/.lock"
flock 9
[[ -f "$out/iwg-worker.tar" ]] && { echo "$out/iwg-worker.tar"; exit 0; }
storage=(--root "$cache/buildah/root" --runroot "$cache/buildah/run" --storage-driver overlay)
tls=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && tls+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
[[ -f /etc/pip.conf ]] && tls+=(-v /etc/pip.conf:/etc/pip.conf:ro)
work="$(mktemp -d "$out/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
started=$SECONDS

if ! buildah "${storage[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  # Debian's python3 and a venv with torch (from uv's cache, where `make setup` left it)
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' "$suite" "$work/rootfs.tar"
  c="$(buildah "${storage[@]}" from scratch)"
  buildah "${storage[@]}" add "$c" "$work/rootfs.tar" / >/dev/null
  run=(buildah "${storage[@]}" run --network host --isolation chroot "${tls[@]}")
  "${run[@]}" "$c" -- python3 -m venv /opt/venv
  "${run[@]}" -e SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt -v "$root/.venv/bin/uv:/opt/uv:ro" \
    -v "$(uv_cache="$("$root/.venv/bin/uv" cache dir)"; mkdir -p "$uv_cache"; echo "$uv_cache"):/uv-cache" \
    "$c" -- /opt/uv pip install -q --native-tls --python /opt/venv/bin/python --cache-dir /uv-cache \
    --link-mode copy "torch==$torch_version"
  buildah "${storage[@]}" config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
  buildah "${storage[@]}" commit -q --rm "$c" "$base" >/dev/null
  echo "build.sh: base $base made in $((SECONDS - started)) s" >&2
fi
based=$SECONDS

buildah "${storage[@]}" bud -q --pull=never --network host --isolation chroot "${tls[@]}" \
  --build-arg "TORCH_IMAGE=$base" -f "$root/worker_image/Dockerfile" -t "$name" "$root" >/dev/null
buildah "${storage[@]}" push -q "$name" "docker-archive:$work/iwg-worker.tar:$name"
size="$(buildah "${storage[@]}" images --format '{{.Size}}' "$name")"
buildah "${storage[@]}" rmi "$name" >/dev/null
mv "$work/iwg-worker.tar" "$out/iwg-worker.tar"
# One image and one base kept: earlier builds' archives (5 GB each) and bases go.
for old in "$cache"/images/worker-*; do [[ "$old" == "$out" ]] || rm -rf "$old"; done
buildah "${storage[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '^iwg.local/torch-base:' | grep -vx "$base" \
  | xargs -r buildah "${storage[@]}" rmi >/dev/null || true
echo "build.sh: $name ($size, archive $(du -sh "$out/iwg-worker.tar" | cut -f1)) built in $((SECONDS - based)) s from the base, $((SECONDS - started)) s in all" >&2
echo "$out/iwg-worker.tar"
