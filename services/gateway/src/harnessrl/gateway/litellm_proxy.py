"""LiteLLM's proxy as the benchmark's point of comparison, in its own venv (never the product's).

The venv lives under `~/.cache/harnessrl/bench-litellm-<version>` and is built on first use with
pip. 1.108.7 is a known-good release (1.82.7 and 1.82.8 were compromised; never install those).
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

from harnessrl.shared.cache import cache_root

LITELLM_VERSION = "1.108.7"
MASTER_KEY = "sk-harnessrl-bench"
_COMPROMISED = frozenset({"1.82.7", "1.82.8"})


def litellm_venv(cache: Path | None = None) -> Path:
    """The venv with LiteLLM's proxy, built once per machine."""
    if LITELLM_VERSION in _COMPROMISED:
        raise RuntimeError(f"litellm {LITELLM_VERSION} is a compromised release")
    root = (cache or cache_root()) / f"bench-litellm-{LITELLM_VERSION}"
    if (root / ".complete").exists():
        return root
    building = root.with_name(root.name + ".tmp")
    if not (building / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(building)], check=True)
        subprocess.run(
            [str(building / "bin" / "pip"), "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"],
            check=True,
        )  # fmt: skip
        (building / ".installed").touch()
    building.rename(root)
    for script in (root / "bin").iterdir():
        _rewrite_shebang(script, str(building), str(root))
    (root / ".complete").touch()
    return root


def _rewrite_shebang(script: Path, old: str, new: str) -> None:
    if not script.is_file() or script.is_symlink():
        return
    try:
        text = script.read_text()
    except UnicodeDecodeError:
        return
    if old in text:
        script.write_text(text.replace(old, new))


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
        [str(venv / "bin" / "litellm"), "--config", str(config), "--port", str(port),
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
