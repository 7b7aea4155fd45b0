"""Building tinyswe: candidates, validation, repositories and `instances.jsonl`.

`ensure_tinyswe()` builds once per machine into a cache folder keyed on the hash of this package's
source (libraries, bugs, generator) and the Python version, guarded by a file lock so parallel test
sessions build it once; `build_tinyswe(out)` copies that into `out`.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harnessrl.reward.tinyswe.handwritten import HAND_BUGS
from harnessrl.reward.tinyswe.instances import (
    Candidate,
    base_files,
    git_diff,
    problem_statement,
)
from harnessrl.reward.tinyswe.library import Library, load_libraries, scaffold
from harnessrl.reward.tinyswe.mutation import mutations
from harnessrl.reward.tinyswe.repos import Snapshot, write_repository
from harnessrl.reward.tinyswe.validate import Verdict, validate
from harnessrl.shared.cache import build_once, cache_root
from harnessrl.shared.log import get_logger

MUTANTS_PER_LIBRARY = 12
INSTANCES_FILE = "instances.jsonl"
_log = get_logger(__name__)


def source_hash() -> str:
    """Hash of everything that decides the built set."""
    digest = hashlib.sha256(sys.version.encode())
    package = Path(__file__).parent
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".txt") and "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _hand_candidates(library: Library) -> list[Candidate]:
    found = []
    for bug in HAND_BUGS:
        if bug.library != library.name:
            continue
        source = library.files[bug.path]
        if source.count(bug.find) != 1:
            raise ValueError(f"hand-written bug text not found exactly once in {bug.path}")
        found.append(
            Candidate(
                library=library.name,
                kind="handwritten",
                path=bug.path,
                source=source.replace(bug.find, bug.replace),
                operator="handwritten",
                function="",
                statement=bug.statement,
                hints=bug.hints,
            )
        )
    return found


def _mutation_candidates(library: Library) -> list[Candidate]:
    found = [
        Candidate(
            library=library.name,
            kind="mutation",
            path=m.path,
            source=m.source,
            operator=m.operator,
            function=m.function,
        )
        for path in library.sources()
        for m in mutations(path, library.files[path])
    ]
    random.Random(f"tinyswe-{library.name}").shuffle(found)  # noqa: S311 - reproducible choice
    return found


def _validated(
    library: Library, candidates: list[Candidate], quota: int, python: str, pool: ThreadPoolExecutor
) -> list[tuple[Candidate, Verdict]]:
    """Validate in order, a pool-sized batch at a time, until `quota` candidates pass."""
    kept: list[tuple[Candidate, Verdict]] = []
    batch = max(2, pool._max_workers)
    tests = library.test_files()
    for start in range(0, len(candidates), batch):
        chunk = candidates[start : start + batch]
        verdicts = pool.map(
            lambda c: validate(library.files, {**library.files, c.path: c.source}, tests, python),
            chunk,
        )
        kept.extend((c, v) for c, v in zip(chunk, verdicts, strict=True) if v is not None)
        if len(kept) >= quota:
            return kept[:quota]
    return kept


def _rows(library: Library, chosen: list[tuple[Candidate, Verdict]], repo_dir: Path) -> list[dict[str, Any]]:
    ids = [f"tinyswe__{library.name}-{n:04d}" for n in range(1, len(chosen) + 1)]
    snapshots = [
        Snapshot(tag=i, message=f"{library.name}: snapshot {i}\n", files=base_files(library, c, v))
        for i, (c, v) in zip(ids, chosen, strict=True)
    ]
    root, commits = write_repository(repo_dir, scaffold(library.name), snapshots)
    rows = []
    for n, (instance_id, (candidate, verdict)) in enumerate(zip(ids, chosen, strict=True)):
        base = base_files(library, candidate, verdict)
        rows.append(
            {
                "instance_id": instance_id,
                "repo": f"tinyswe/{library.name}",
                "base_commit": commits[instance_id],
                "patch": git_diff(candidate.path, candidate.source, library.files[candidate.path]),
                "test_patch": "".join(git_diff(p, base[p], library.files[p]) for p in verdict.test_files),
                "problem_statement": problem_statement(library, candidate, verdict),
                "hints_text": candidate.hints,
                "created_at": f"2026-01-{1 + n % 28:02d}T00:00:00Z",
                "version": "0.1",
                "environment_setup_commit": root,
                "FAIL_TO_PASS": json.dumps(verdict.fail_to_pass),
                "PASS_TO_PASS": json.dumps(verdict.pass_to_pass),
                "repo_path": f"repos/{library.name}",
                "bug_kind": candidate.kind,
                "bug_operator": candidate.operator,
            }
        )
    return rows


def _choose(
    library: Library, python: str, pool: ThreadPoolExecutor, per_library: int
) -> list[tuple[Candidate, Verdict]]:
    hand = _validated(library, _hand_candidates(library), len(HAND_BUGS), python, pool)
    seen = {c.source for c, _ in hand}
    mutants = [c for c in _mutation_candidates(library) if c.source not in seen]
    return hand + _validated(library, mutants, per_library, python, pool)


def generate(out: Path, *, python: str, workers: int = 2, per_library: int = MUTANTS_PER_LIBRARY) -> int:
    """Build the task set into the empty folder `out`; returns the number of instances."""
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for library in load_libraries():
            chosen = _choose(library, python, pool, per_library)
            rows.extend(_rows(library, chosen, out / "repos" / library.name))
            _log.info("library.built", library=library.name, instances=len(chosen))
    with (out / INSTANCES_FILE).open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    return len(rows)


def ensure_tinyswe(python: str | None = None) -> Path:
    """The cached task set for this generator source, built first if missing."""
    target = cache_root() / f"tinyswe-{source_hash()}"
    return build_once(
        target, lambda staging: generate(staging, python=python or sys.executable), done=INSTANCES_FILE
    )


def build_tinyswe(out: Path, python: str | None = None) -> Path:
    """Copy the (cached) task set into `out`, replacing a previous build there."""
    built = ensure_tinyswe(python)
    for name in ("repos", INSTANCES_FILE):
        existing = out / name
        if existing.is_dir():
            shutil.rmtree(existing)
        elif existing.exists():
            existing.unlink()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(built / "repos", out / "repos", symlinks=True)
    shutil.copy2(built / INSTANCES_FILE, out / INSTANCES_FILE)
    return out / INSTANCES_FILE


def load_instances(root: Path) -> list[dict[str, Any]]:
    """The rows of a built task set."""
    with (root / INSTANCES_FILE).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
