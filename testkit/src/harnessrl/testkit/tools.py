"""Where the tests find the tools `scripts/tools.sh` installs into this machine's cache."""

from __future__ import annotations

from harnessrl.shared.cache import cache_root

HELM = cache_root() / "helm-kubectl-v33" / "helm"
MINI_SWE_AGENT = cache_root() / "harness-mini-swe-agent-2.4.6" / "bin" / "mini"
CLAUDE_CODE_VERSION = "2.1.332"
CLAUDE_CODE = cache_root() / f"harness-claude-code-{CLAUDE_CODE_VERSION}" / "node_modules" / ".bin" / "claude"
CODEX_VERSION = "0.171.0"
CODEX = cache_root() / f"harness-codex-{CODEX_VERSION}" / "node_modules" / ".bin" / "codex"
