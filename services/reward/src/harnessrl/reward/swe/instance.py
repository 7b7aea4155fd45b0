"""A SWE-bench 5.x task instance as our grader reads it."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from harnessrl.reward.errors import RewardError
from harnessrl.shared.taskpaths import BaseCommitError, check_base_commit


class InstanceError(RewardError, ValueError):
    """The instance row is missing fields or has malformed ones."""


class SweInstance(msgspec.Struct, frozen=True, kw_only=True):
    """The fields grading uses; FAIL_TO_PASS and PASS_TO_PASS are decoded lists."""

    instance_id: str
    repo: str = ""
    base_commit: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    patch: str = ""
    repo_path: str | None = None
    image: str | None = None
    repo_dir: str = "/testbed"
    # SWE-bench 5.x rows grade by their own eval script (run in the instance image), read by the
    # swebench log parser they name (else their repository's) under their eval type.
    version: str = ""
    eval_script: str = ""
    log_parser: str = ""
    eval_type: str = ""

    @property
    def official(self) -> bool:
        """Graded by the row's own eval script and swebench's parser (else by our pytest run)."""
        return bool(self.eval_script)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SweInstance:
        """Read a JSONL row (lists may be JSON-encoded strings, as SWE-bench stores them)."""
        try:
            return cls(
                instance_id=str(row["instance_id"]),
                repo=str(row.get("repo", "")),
                base_commit=check_base_commit(str(row["base_commit"])),
                test_patch=str(row["test_patch"]),
                fail_to_pass=_test_list(row, "FAIL_TO_PASS"),
                pass_to_pass=_test_list(row, "PASS_TO_PASS"),
                patch=str(row.get("patch", "")),
                repo_path=row.get("repo_path"),
                image=row.get("image"),
                repo_dir=str(row.get("repo_dir", "/testbed")),
                version=str(row.get("version") or ""),
                eval_script=str(row.get("eval_script") or ""),
                log_parser=str(row.get("log_parser") or ""),
                eval_type=str(row.get("eval_type") or ""),
            )
        except KeyError as exc:
            raise InstanceError(f"instance is missing {exc.args[0]!r}") from exc
        except BaseCommitError as exc:
            raise InstanceError(str(exc)) from exc

    def test_files(self, test_patch_paths: list[str]) -> list[str]:
        """The files pytest runs: the Python files the test patch touches."""
        return [path for path in test_patch_paths if path.endswith(".py")]


def _test_list(row: dict[str, Any], key: str) -> list[str]:
    value = row.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{key} is not a JSON list") from exc
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InstanceError(f"{key} must be a list of test ids")
    return value
