#!/usr/bin/env bash
# Builds (or reuses) the project virtualenv and links it as .venv.
#
# The environment lives outside the clone, under ~/.cache/harnessrl, keyed on a hash of the lock
# file and this script, so every clone on a machine shares one build and a fresh machine builds it.
# Third-party packages come from requirements.lock with --no-deps (exact, no resolver surprises);
# torch goes through pip because only pip finds the CPU build on disk. Our own packages are
# installed editable into that environment, pointing at this clone.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PYTHON:-python3}
cache=${HARNESSRL_CACHE:-$HOME/.cache/harnessrl}
key=$(sha256sum < requirements.lock | cut -c1-16)
venv="$cache/venv-$key"
packages=(shared services/gateway services/controller services/reward services/trainer stack testkit benchmarks)

mkdir -p "$cache"
exec 9>"$cache/.dev.lock"
flock 9  # one build at a time per machine (parallel `make` calls wait here)

if [ ! -f "$venv/.complete" ]; then
  echo "building $venv (first time on this machine: a few minutes)"
  rm -rf "$venv" "$venv.tmp"
  mkdir -p "$cache"
  "$py" -m venv "$venv.tmp"
  "$venv.tmp/bin/pip" install --quiet --no-deps -r requirements.lock 2>&1 | grep -v "^WARNING: Location" || true
  test -x "$venv.tmp/bin/python" && "$venv.tmp/bin/python" -c "import torch, vllm, verl, nats"
  mv "$venv.tmp" "$venv"
  # venv scripts carry the build path in their shebangs: rewrite them for the final location.
  grep -rlI --exclude-dir=__pycache__ "$venv.tmp" "$venv/bin" | xargs -r sed -i "s#$venv.tmp#$venv#g"
  touch "$venv/.complete"
fi
ln -sfn "$venv" .venv

stamp="$venv/.editable-root"
if [ "$(cat "$stamp" 2>/dev/null)" != "$root ${packages[*]}" ]; then
  args=()
  for p in "${packages[@]}"; do args+=(-e "$p"); done
  .venv/bin/pip install --quiet --no-deps --no-build-isolation \
    --config-settings editable_mode=compat "${args[@]}"
  echo "$root ${packages[*]}" > "$stamp"
fi

bash scripts/tools.sh
echo "dev environment ready: .venv -> $venv"
