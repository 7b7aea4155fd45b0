"""Grade one patch for one instance in the local sandbox.

Steps: check the patch; clone the pristine repository at base_commit into a fresh directory;
apply the patch (four strategies); restore test files and test configuration; apply the test
patch; run pytest on the test patch's files only, as nobody, without network, JUnit XML written
outside the repository; cross-check exit code, report and log; resolve by SWE-bench rules.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from harnessrl.reward.graders.base import Grade, GradingContext, Outcome
from harnessrl.reward.swe import forgery
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.patchfile import InvalidPatchError, Patch, parse_patch
from harnessrl.reward.swe.podrunner import add_canaries, pytest_command
from harnessrl.reward.swe.rules import evaluate, exit_code_agrees, log_agrees, reward_of
from harnessrl.reward.swe.sandbox import (
    RunResult,
    base_environment,
    check_sandbox,
    confinement,
    give_to,
    grading_uid,
    run_sandboxed,
)
from harnessrl.reward.swe.testlog import ReportError, parse_junit, parse_pytest_log
from harnessrl.reward.swe.workspace import (
    WorkspaceError,
    apply_patch,
    apply_test_patch,
    clone_pristine,
    restore_protected,
)

LOG_TAIL_BYTES = 4000


def _fail(outcome: str, reward_error: str, **details: Any) -> Grade:
    return Grade(reward=0.0, resolved=False, outcome=outcome, details={"reason": reward_error, **details})  # type: ignore[arg-type]


async def grade_patch(
    instance: SweInstance, pristine: Path, artifact: bytes, context: GradingContext
) -> Grade:
    """Grade `artifact` (the agent's diff) against `instance`, whose repository is `pristine`."""
    started = time.monotonic()
    try:
        patch = parse_patch(artifact, limit=context.max_artifact_bytes)
    except InvalidPatchError as exc:
        return _fail("invalid-artifact", str(exc))
    if patch.empty:
        return _fail("empty-patch", "the patch is empty")
    test_patch = parse_patch(instance.test_patch.encode(), limit=64 * 1024 * 1024)
    with tempfile.TemporaryDirectory(prefix="hrl-grade-", dir=context.work_root) as tmp:
        root = Path(tmp)
        try:
            grade = await _grade_in(root, instance, pristine, patch, test_patch, context)
        except WorkspaceError as exc:
            return Grade(reward=0.0, outcome="infra-error", details={"reason": str(exc)})
    grade.details["durations"]["total_s"] = round(time.monotonic() - started, 4)
    return grade


async def _grade_in(
    root: Path,
    instance: SweInstance,
    pristine: Path,
    patch: Patch,
    test_patch: Patch,
    context: GradingContext,
) -> Grade:
    check_sandbox(context.limits, context.python)  # refuse before the patch is touched, not after
    repo = root / "repo"
    started = time.monotonic()
    uid = grading_uid()
    base = await clone_pristine(pristine, instance.base_commit, repo)
    (root / "model.diff").write_text(patch.text)
    (root / "home").mkdir()
    _hand_over(root, context, uid)
    strategy, errors = await apply_patch(
        repo, root / "model.diff", confinement(context.limits, uid), base_environment(root / "home")
    )
    if strategy is None:
        return _fail(
            "patch-failed",
            "no strategy applied the patch",
            errors=errors,
            durations={"apply_s": round(time.monotonic() - started, 4)},
        )
    reset = await restore_protected(repo, base, test_patch.paths)
    (root / "test.diff").write_text(test_patch.text)
    await apply_test_patch(repo, root / "test.diff")
    shutil.rmtree(repo / ".git")
    files = instance.test_files(test_patch.paths)
    canaries = add_canaries(repo, files)
    apply_s = time.monotonic() - started
    run, junit, log, verdict = await _run_tests(root, repo, files, context, uid)
    details: dict[str, Any] = {
        "patch_strategy": strategy,
        "reset_paths": reset,
        "exit_code": run.exit_code,
        "network_isolated": run.network_isolated,
        "unprivileged": run.unprivileged,
        "durations": {"apply_s": round(apply_s, 4), "test_s": round(run.duration_s, 4)},
    }
    if run.timed_out:
        details["reason"] = f"tests ran past {context.limits.timeout_s}s"
        return Grade(reward=0.0, resolved=False, outcome="timeout", details=details)
    if junit is None:
        details["log_tail"] = log[-LOG_TAIL_BYTES:]
        if not await _pytest_runs(root, context, uid):
            details["reason"] = "pytest cannot run in the sandbox"
            return Grade(reward=0.0, outcome="infra-error", details=details)
        details["reason"] = "pytest started but left no readable report"
        return Grade(reward=0.0, resolved=False, outcome="inconsistent", details=details)
    return _resolve(instance, junit, log, run, details, context, Integrity(verdict, canaries))


async def _pytest_runs(root: Path, context: GradingContext, uid: int) -> bool:
    """Whether pytest starts at all: tells a broken environment from a patch that killed the run."""
    probe = root / "probe"
    probe.mkdir()
    run = await run_sandboxed(
        [context.python, "-I", "-m", "pytest", "--version"],
        cwd=probe,
        log_path=root / "probe.log",
        env=base_environment(probe),
        limits=context.limits,
        uid=uid,
    )
    return run.exit_code == 0


async def _run_tests(
    root: Path, repo: Path, files: list[str], context: GradingContext, uid: int
) -> tuple[RunResult, dict[str, str] | None, str, forgery.Verdict | None]:
    report_dir, home = root / "report", root / "home"
    report_dir.mkdir()
    _hand_over(root, context, uid)  # again: the reset, the test patch and the canaries were the grader's
    runner = _place_runner(root)
    report, verdict = report_dir / "junit.xml", report_dir / "verdict.json"
    log_path = root / "pytest.log"
    run = await run_sandboxed(
        pytest_command(context.python, runner, verdict, report, files),
        cwd=repo,
        log_path=log_path,
        env=base_environment(home),
        limits=context.limits,
        uid=uid,
    )
    junit: dict[str, str] | None = None
    if report.is_file():
        with contextlib.suppress(ReportError):
            junit = parse_junit(report.read_bytes())
    log = log_path.read_bytes().decode("utf-8", errors="replace")
    raw_verdict = verdict.read_bytes()[: 1024 * 1024] if verdict.is_file() else None
    return run, junit, log, forgery.read_verdict(raw_verdict)


def _hand_over(root: Path, context: GradingContext, uid: int) -> None:
    """The workspace to the grading's user, when gradings drop privileges (`check_sandbox` ran)."""
    if context.limits.drop_privileges:
        give_to(root, uid)


def _place_runner(root: Path) -> Path:
    """The integrity runner, in a folder of the grader's that the sandboxed user cannot change."""
    folder = root / "grader"
    folder.mkdir(mode=0o755)
    runner = folder / "integrity.py"
    runner.write_bytes(Path(forgery.__file__).with_name("integrity.py").read_bytes())
    runner.chmod(0o444)
    return runner


class Integrity(NamedTuple):
    """What the grader planted and saw: the integrity verdict and the canaries' node ids."""

    verdict: forgery.Verdict | None
    canaries: dict[str, str]


def _resolve(
    instance: SweInstance,
    junit: dict[str, str],
    log: str,
    run: RunResult,
    details: dict[str, Any],
    context: GradingContext,
    integrity: Integrity,
) -> Grade:
    graded = instance.fail_to_pass + instance.pass_to_pass
    report = evaluate(junit, instance.fail_to_pass, instance.pass_to_pass, context.rules)
    logged = parse_pytest_log(log)
    details.update(
        tests={case: junit.get(case, "MISSING") for case in graded},
        FAIL_TO_PASS={"success": report.f2p_success, "failure": report.f2p_failure},
        PASS_TO_PASS={"success": report.p2p_success, "failure": report.p2p_failure},
        f2p_rate=report.f2p_rate,
        p2p_rate=report.p2p_rate,
        resolution="RESOLVED_NO",
        log_tail=log[-LOG_TAIL_BYTES:],
        **forgery.details_of(integrity.verdict, integrity.canaries, junit),
    )
    reason, outcome = _distrust(junit, logged, run, integrity, graded)
    if reason:
        details["reason"] = reason
        return Grade(reward=0.0, resolved=False, outcome=outcome, details=details)
    details["resolution"] = report.resolution
    return Grade(
        reward=reward_of(report, context.rules),
        resolved=report.resolved,
        outcome="graded",
        details=details,
    )


def _distrust(
    junit: dict[str, str], logged: dict[str, str], run: RunResult, integrity: Integrity, graded: list[str]
) -> tuple[str, Outcome]:
    """Why the run's report cannot be taken as it is ("" when it can), and the outcome that makes."""
    verdict = integrity.verdict
    forged = forgery.forged(junit, logged, verdict, integrity.canaries) if verdict is not None else []
    if forged:
        return "; ".join(forged), "forgery"
    if verdict is None or verdict.exit_code != run.exit_code:
        return "the test process did not end as pytest ended it (no verdict, or another code)", "inconsistent"
    if not exit_code_agrees(run.exit_code, junit):
        return "exit code disagrees with the test report", "inconsistent"
    if not log_agrees(junit, logged, graded):
        return "test log disagrees with the test report", "inconsistent"
    return "", "graded"


def resolve_output(
    instance: SweInstance, output: Any, context: GradingContext, sandbox: str = "kubernetes"
) -> Grade:
    """Grade a grading pod's output (see `swe.kube.parse_pod_output`); `sandbox` ran the pod."""
    details: dict[str, Any] = {"patch_strategy": output.strategy, "sandbox": sandbox, "durations": {}}
    if output.result == "patch-failed":
        return _fail("patch-failed", "no strategy applied the patch", **details)
    if output.exit_code is None:
        details["log_tail"] = output.log[-LOG_TAIL_BYTES:]
        return Grade(
            reward=0.0,
            outcome="infra-error",
            details={**details, "reason": "the grading pod reported no result"},
        )
    try:
        junit = parse_junit(output.junit) if output.junit else None
    except ReportError:
        junit = None
    if junit is None:
        details["reason"] = "pytest started but left no readable report"
        return Grade(reward=0.0, resolved=False, outcome="inconsistent", details=details)
    run = RunResult(
        exit_code=output.exit_code, timed_out=False, duration_s=0.0, network_isolated=True, unprivileged=True
    )
    details.update(exit_code=output.exit_code)
    integrity = Integrity(forgery.read_verdict(output.verdict), forgery.read_canaries(output.canaries))
    return _resolve(instance, junit, output.log, run, details, context, integrity)
