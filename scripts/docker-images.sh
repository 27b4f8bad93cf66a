#!/bin/sh
# Makes the base images of deploy/docker-compose.yml where no image registry is reachable, from
# Debian packages only: a minimal Debian 13 (trixie: Node >= 20, which bookworm lacks) made with
# debootstrap and `docker import`, and a NATS image from Debian's nats-server package
# (deploy/Dockerfile.nats). Run as root, with docker.io (and docker-compose) and debootstrap
# installed. Each image is made once: its tag is a hash of what makes it (this script and
# Dockerfile.nats), and an image that exists is kept.
#
# It prints the variables the compose file reads, for `export $(scripts/docker-images.sh)`:
#   MT_BASE_IMAGE=meshtrain-debian:trixie-<hash>
#   MT_NATS_IMAGE=meshtrain-nats:<hash>
# --tags prints them without making anything. MT_DEBIAN_MIRROR picks another Debian mirror.
set -eu

suite=trixie
mirror=${MT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(cd "$(dirname "$0")/.." && pwd)
hash=$(cat "$0" "$root/deploy/Dockerfile.nats" | sha256sum | cut -c1-12)
base=meshtrain-debian:$suite-$hash
nats=meshtrain-nats:$hash

if [ "${1:-}" = "--tags" ]; then
  echo "MT_BASE_IMAGE=$base"
  echo "MT_NATS_IMAGE=$nats"
  exit 0
fi

have() { docker image inspect "$1" >/dev/null 2>&1; }

# Progress goes to stderr: stdout carries only the variables.
if ! have "$base"; then
  if ! command -v debootstrap >/dev/null; then
    echo "debootstrap is missing: apt-get install -y debootstrap" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "making $base: debootstrap --variant=minbase $suite from $mirror" >&2
  debootstrap --variant=minbase "$suite" "$tmp/rootfs" "$mirror" >&2
  # the downloaded packages and package lists: the image's own apt-get update fetches fresh lists
  rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"*
  tar -C "$tmp/rootfs" -c . | docker import - "$base" >&2
fi

if ! have "$nats"; then
  echo "making $nats from Debian's nats-server" >&2
  docker build --network host --build-arg "BASE_IMAGE=$base" -f "$root/deploy/Dockerfile.nats" -t "$nats" "$root/deploy" >&2
fi

echo "MT_BASE_IMAGE=$base"
echo "MT_NATS_IMAGE=$nats"
