"""Where the tests find the tools `scripts/tools.sh` installs into this machine's cache."""

from __future__ import annotations

from harnessrl.shared.cache import cache_root

HELM = cache_root() / "helm-kubectl-v33" / "helm"
MINI_SWE_AGENT = cache_root() / "harness-mini-swe-agent-2.4.6" / "bin" / "mini"
