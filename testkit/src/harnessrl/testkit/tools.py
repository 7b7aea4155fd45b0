"""Where the tests find the tools `scripts/tools.sh` installs into this machine's cache."""

from __future__ import annotations

from harnessrl.shared.cache import cache_root
from harnessrl.stack.demo.swe_demos import MINI_SWE_AGENT

__all__ = ["CLAUDE_CODE", "CLAUDE_CODE_VERSION", "CODEX", "CODEX_VERSION", "HELM", "MINI_SWE_AGENT"]

HELM = cache_root() / "helm-kubectl-v33" / "helm"
CLAUDE_CODE_VERSION = "2.1.332"
CLAUDE_CODE = cache_root() / f"harness-claude-code-{CLAUDE_CODE_VERSION}" / "node_modules" / ".bin" / "claude"
CODEX_VERSION = "0.171.0"
CODEX = cache_root() / f"harness-codex-{CODEX_VERSION}" / "node_modules" / ".bin" / "codex"
