#!/usr/bin/env bash
# Test-only set-up of the container-image machinery (runtime/sandbox/images, docs/images.md):
#
#   Debian packages   skopeo (fetch), umoci (rootless unpack), buildah (daemonless Dockerfile
#                     builds), docker-registry (the CNCF distribution server the tests run on
#                     loopback), mmdebstrap (the base image), busybox-static (the tiny test
#                     image's one binary), bash-static (the shell the image sandboxes fall back
#                     to in images without bash), uidmap (newuidmap/newgidmap: a rootless
#                     server maps its /etc/subuid range into image sandboxes so the image's
#                     file owners hold; the tests make a user with a range), musl-tools (musl's
#                     loader and libc, and musl-gcc: the musl image fixture, an Alpine-like
#                     root, links its program against musl) with libc6-dev (its glibc twin).
#   base image        an OCI layout of Debian bookworm minbase + python3, made ONCE with
#                     mmdebstrap and cached under the set-up cache, keyed by its recipe:
#                     <cache>/image-base-<key>/ (layout: oci:<dir>/oci:base), and a link
#                     <cache>/current-image-base to it. The tests push it into their loopback
#                     registry as python:3.11-slim and friends.
#
# Idempotent (stamps), quiet when done. ROLLOUT_SKIP_IMAGES=1 skips it; the image tests then
# skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${ROLLOUT_SKIP_IMAGES:-0}" = "1" ]; then
  echo "setup_images: skipped (ROLLOUT_SKIP_IMAGES=1)"
  exit 0
fi

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
need=()
for pair in skopeo:skopeo umoci:umoci buildah:buildah docker-registry:docker-registry \
            mmdebstrap:mmdebstrap busybox:busybox-static bash-static:bash-static \
            newuidmap:uidmap musl-gcc:musl-tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
# busybox may come from the dynamic package; the tests want the static one.
[ -e /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q 'statically' \
  || dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
[ -e /usr/include/stdio.h ] || need+=(libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${need[@]}" >/dev/null
fi

CACHE=${ROLLOUT_SETUP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service}
SUITE=bookworm
MIRROR=${ROLLOUT_DEBIAN_MIRROR:-}
if [ -z "$MIRROR" ]; then
  MIRROR=$(grep -rhoE '^(deb|URIs:)\s*\S+' /etc/apt/sources.list /etc/apt/sources.list.d/ \
    2>/dev/null | awk '{print $2}' | grep -E 'debian/?$' | head -1 || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

make_base() {  # $1: target directory (an OCI layout with the tag "base")
  local work
  work=$(mktemp -d)
  mmdebstrap --quiet --variant=minbase --include=python3 --format=tar "$SUITE" \
    "$work/rootfs.tar" "$MIRROR"
  umoci init --layout "$1"
  umoci new --image "$1:base"
  mkdir -p "$work/bundle"
  umoci unpack --rootless --image "$1:base" "$work/bundle"
  tar -C "$work/bundle/rootfs" -xf "$work/rootfs.tar" --exclude='./dev/*'
  # `python` as the python:3.X-slim images have it (Debian's python3 package ships python3 only).
  ln -s python3 "$work/bundle/rootfs/usr/bin/python"
  umoci repack --image "$1:base" "$work/bundle"
  umoci config --image "$1:base" --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.env LANG=C.UTF-8 --config.cmd /bin/bash --architecture amd64 --os linux
  umoci gc --layout "$1"
  rm -rf "$work"
}

want="$({ declare -f make_base; echo "$SUITE python3 minbase"; } | sha256sum | cut -c1-16)"
dir=$CACHE/image-base-$want
if [ "$(cat "$dir/.setup-stamp" 2>/dev/null)" != "$want" ]; then
  t0=$SECONDS
  mkdir -p "$CACHE"
  rm -rf "$dir" "$dir.tmp"
  make_base "$dir.tmp"
  echo "$want" > "$dir.tmp/.setup-stamp"
  mv "$dir.tmp" "$dir"
  ln -sfn "$(basename "$dir")" "$CACHE/current-image-base"
  for old in "$CACHE"/image-base-*; do  # earlier recipes' images
    [ "$old" = "$dir" ] || rm -rf "$old"
  done
  echo "setup_images: base image $dir built in $((SECONDS - t0)) s"
fi
[ "$(readlink "$CACHE/current-image-base" 2>/dev/null)" = "$(basename "$dir")" ] \
  || ln -sfn "$(basename "$dir")" "$CACHE/current-image-base"
