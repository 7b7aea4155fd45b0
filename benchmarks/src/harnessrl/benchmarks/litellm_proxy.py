"""LiteLLM's proxy as the benchmark's point of comparison, in its own venv (never the product's).

The venv lives under `$HARNESSRL_CACHE/bench-litellm-<version>` (default `~/.cache/harnessrl`) and
is built on first use with pip. 1.108.7 is a known-good release (1.82.7 and 1.82.8 were compromised;
never install those).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from harnessrl.shared.cache import build_once, cache_root

LITELLM_VERSION = "1.108.7"
MASTER_KEY = "sk-harnessrl-bench"
_COMPROMISED = frozenset({"1.82.7", "1.82.8"})
_LITELLM = "bin/litellm"  # the proxy's command, there once the venv is complete


def litellm_venv(cache: Path | None = None) -> Path:
    """The venv with LiteLLM's proxy, built once per machine."""
    if LITELLM_VERSION in _COMPROMISED:
        raise RuntimeError(f"litellm {LITELLM_VERSION} is a compromised release")

    def build(staging: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True)
        pip = [str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"litellm[proxy]=={LITELLM_VERSION}"], check=True)

    root = (cache or cache_root()) / f"bench-litellm-{LITELLM_VERSION}"
    return build_once(root, build, done=_LITELLM)


def start_litellm(venv: Path, upstream: str, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """Start the proxy with one model routed to `upstream` (an OpenAI-compatible base URL)."""
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: canned\n"
        "    litellm_params:\n"
        "      model: openai/canned\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
    )
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": MASTER_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
    }
    log = (workdir / "litellm.log").open("wb")
    return subprocess.Popen(
        # The venv's python runs the script: its shebang still names the staging folder it was built in.
        [str(venv / "bin" / "python"), str(venv / _LITELLM), "--config", str(config), "--port", str(port),
         "--host", "127.0.0.1", "--num_workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True,
    )  # fmt: skip


def wait_http(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - loopback URL
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(request, timeout=2) as response,  # noqa: S310
        ):
            if response.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s")
