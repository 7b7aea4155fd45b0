"""Turning a validated bug into a SWE-bench 5.x instance: base tree, gold patch, test patch."""

from __future__ import annotations

import ast
import difflib
import re

import msgspec

from harnessrl.reward.tinyswe.library import Library
from harnessrl.reward.tinyswe.validate import Verdict


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A buggy variant of one library module, before validation."""

    library: str
    kind: str  # "mutation" or "handwritten"
    path: str
    source: str
    operator: str
    function: str
    statement: str = ""
    hints: str = ""


def git_diff(path: str, before: str, after: str) -> str:
    """A git-style unified diff of one file (3 lines of context)."""
    body = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{path}",
        tofile=f"b/{path}",
    )
    text = "".join(body)
    return f"diff --git a/{path} b/{path}\n{text}" if text else ""


def without_tests(source: str, names: set[str]) -> str:
    """`source` with the module-level test functions called `names` removed."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.update(range(first - 1, node.end_lineno or node.lineno))
    kept = "".join(line for index, line in enumerate(lines) if index not in drop)
    return re.sub(r"\n{3,}", "\n\n\n", kept).rstrip("\n") + "\n"


def _function_name(test_id: str) -> str:
    return test_id.rsplit("::", maxsplit=1)[-1].split("[", 1)[0]


def _test_sources(library: Library, verdict: Verdict, limit: int = 3) -> list[str]:
    shown: list[str] = []
    seen: set[str] = set()
    for test_id in verdict.fail_to_pass:
        path, name = test_id.split("::", 1)[0], _function_name(test_id)
        if name in seen:
            continue
        seen.add(name)
        for node in ast.parse(library.files[path]).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                shown.append(ast.get_source_segment(library.files[path], node) or "")
    return shown[:limit]


def _docstring(library: Library, candidate: Candidate) -> str:
    for node in ast.walk(ast.parse(library.files[candidate.path])):
        if isinstance(node, ast.FunctionDef) and node.name == candidate.function:
            return (ast.get_docstring(node) or "").strip()
    return ""


def problem_statement(library: Library, candidate: Candidate, verdict: Verdict) -> str:
    """The issue text: hand-written, or derived from the docstring and the failing checks."""
    if candidate.statement:
        return candidate.statement
    module = candidate.path.removesuffix(".py").replace("/", ".")
    doc = _docstring(library, candidate)
    parts = [f"`{candidate.function}` in `{module}` does not behave as documented\n"]
    if doc:
        parts.append(f"Its documentation says:\n\n> {doc.splitlines()[0]}\n")
    parts.append("These checks fail with the current code:\n")
    parts.extend(f"```python\n{source}\n```\n" for source in _test_sources(library, verdict))
    return "\n".join(parts)


def base_files(library: Library, candidate: Candidate, verdict: Verdict) -> dict[str, str]:
    """The tree at base_commit: the bug in, the FAIL_TO_PASS test functions out."""
    files = dict(library.files)
    files[candidate.path] = candidate.source
    names_by_file: dict[str, set[str]] = {}
    for test_id in verdict.fail_to_pass:
        names_by_file.setdefault(test_id.split("::", 1)[0], set()).add(_function_name(test_id))
    for path, names in names_by_file.items():
        files[path] = without_tests(files[path], names)
    return files
