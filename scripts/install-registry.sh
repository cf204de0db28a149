#!/usr/bin/env bash
# Unpack Debian's docker-registry (CNCF Distribution) into .tools/docker-registry for the registry tests.
# Download + dpkg-deb -x instead of apt-get install: no system user, no service on :5000, no root-owned state.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/docker-registry
bin="$dest/usr/bin/docker-registry"
if [ -x "$bin" ]; then
  echo "docker-registry: $bin"
  exit 0
fi
work=$(mktemp -d) && chmod 777 "$work"  # apt downloads as its _apt user
trap 'rm -rf "$work"' EXIT
# apt-get download needs package lists; update once when the candidate is unknown.
if ! apt-cache policy docker-registry 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  apt-get update -qq
fi
(cd "$work" && apt-get download -qq docker-registry)
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
dpkg-deb -x "$work"/docker-registry_*.deb "$dest.tmp"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
"$bin" --version
