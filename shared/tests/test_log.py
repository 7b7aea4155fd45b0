"""Logging set-up: HTTP clients' per-request lines stay out of info-level logs."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import logging, sys
from harnessrl.shared.log import configure_logging
configure_logging("json", sys.argv[1])
logging.getLogger("httpx2").info("HTTP Request: POST /v1/chat/completions 200")
logging.getLogger("openai").warning("a warning still shows")
logging.getLogger("harnessrl.x").info("our own info shows")
"""


@pytest.mark.parametrize(("level", "per_request_shown"), [("INFO", False), ("DEBUG", True)])
def test_per_request_client_logs_only_when_debugging(level: str, per_request_shown: bool) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, level], capture_output=True, text=True, check=True)
    assert ("HTTP Request" in done.stderr) is per_request_shown
    assert "a warning still shows" in done.stderr and "our own info shows" in done.stderr
