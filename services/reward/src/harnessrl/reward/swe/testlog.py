"""Test statuses from a pytest run: the JUnit XML we trust, and the `-rA` log SWE-bench parses.

Statuses use SWE-bench's vocabulary: PASSED, FAILED, SKIPPED, ERROR, XFAIL. The JUnit report is
the source of truth in our sandbox (printed lines cannot forge it); the `-rA` log is read by
swebench's `parse_log_pytest`, to cross-check the report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree as ET

from harnessrl.reward.errors import RewardError
from harnessrl.reward.swe import official

PASSED = "PASSED"
FAILED = "FAILED"
SKIPPED = "SKIPPED"
ERROR = "ERROR"
XFAIL = "XFAIL"
# When one test id is reported twice (setup error after a pass, a forged duplicate), the worst wins.
_SEVERITY = {PASSED: 0, XFAIL: 1, SKIPPED: 2, FAILED: 3, ERROR: 4}
MAX_REPORT_BYTES = 16 * 1024 * 1024


class ReportError(RewardError, ValueError):
    """The JUnit report is missing, too large or not valid XML."""


def _worse(old: str | None, new: str) -> str:
    if old is None:
        return new
    return new if _SEVERITY[new] > _SEVERITY[old] else old


def parse_pytest_log(log: str) -> dict[str, str]:
    """Statuses from pytest `-rA` summary lines: swebench's own `parse_log_pytest`."""
    parse: Callable[[str, Any], dict[str, str]] = official.swebench().registry["parse_log_pytest"]
    return parse(log, None)


def _node_id(case: ET.Element) -> str | None:
    """Rebuild the pytest node id from an xunit1 testcase (`file`, `classname`, `name`)."""
    file = case.get("file")
    name = case.get("name")
    classname = case.get("classname", "")
    if not file or not name or not file.endswith(".py"):
        return None
    if not classname:
        return file  # a collection error: pytest's log reports it as `ERROR <file>` too
    module = file[: -len(".py")].replace("/", ".")
    if classname != module and not classname.startswith(module + "."):
        return None
    classes = classname[len(module) + 1 :].split(".") if classname != module else []
    return "::".join([file, *[c for c in classes if c], name])


def _case_status(case: ET.Element) -> str:
    status = PASSED
    for child in case:
        if child.tag == "error":
            status = _worse(status, ERROR)
        elif child.tag == "failure":
            status = _worse(status, FAILED)
        elif child.tag == "skipped":
            skipped = XFAIL if child.get("type") == "pytest.xfail" else SKIPPED
            status = _worse(status, skipped)
    return status


def parse_junit(xml: bytes) -> dict[str, str]:
    """Statuses by node id from a pytest JUnit report written with `junit_family=xunit1`.

    A collection error is reported under its file's path (as the `-rA` log does); the tests it hid
    are missing, which grades as a failure.
    """
    if len(xml) > MAX_REPORT_BYTES:
        raise ReportError("junit report too large")
    try:
        root = ET.fromstring(xml)  # noqa: S314 - pytest's own output in our sandbox
    except ET.ParseError as exc:
        raise ReportError(f"junit report is not valid XML: {exc}") from exc
    statuses: dict[str, str] = {}
    for case in root.iter("testcase"):
        node = _node_id(case)
        if node is not None:
            statuses[node] = _worse(statuses.get(node), _case_status(case))
    return statuses
