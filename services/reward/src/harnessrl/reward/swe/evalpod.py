"""Official grading in the instance's own image: the model's patch, then the row's eval script.

SWE-bench 5.x rows ship the script that runs their tests (`eval_script`: activate the repository's
environment, reset and apply the test files, run the repository's own runner between output
markers). A grading pod runs it as the dataset's authors do, after our own steps: the patch
strategies (the same list as the pytest path, from `podrunner.APPLY_STRATEGIES`), the protected
paths the patch touched put back, and the repository's history cut to the base commit (the eval
script needs git, so `.git` stays, but no later commit, tag, stash or reflog entry is reachable).
The runner is bash and git only: a Multilingual image need not have Python.

The log is read by swebench (`official.grade_log`): its parser for the row, its validity rules and
its report. That is exactly as forgeable as swebench's own grading (printed result lines are
believed; the recorded test exit code catches a failing run that prints no failure); the pytest
path's canaries and integrity runner do not apply here.
"""

from __future__ import annotations

import shlex
from typing import Any

from harnessrl.reward.graders.base import Grade
from harnessrl.reward.settings import GradingRules
from harnessrl.reward.swe import official
from harnessrl.reward.swe.instance import SweInstance
from harnessrl.reward.swe.patchfile import Patch
from harnessrl.reward.swe.podrunner import APPLY_STRATEGIES, RESULT, STRATEGY
from harnessrl.reward.swe.rules import reward_of
from harnessrl.reward.swe.workspace import is_protected

LOG_TAIL_BYTES = 4000
# Run by bash in the pod; `{strategies}` lists the patch strategies, one per line.
RUNNER = """\
set -u
grading=${{GRADING_DIR:-/grading}}
cd "$REPO_DIR" || {{ echo "{result}: infra-error no repository at $REPO_DIR"; exit 0; }}
applied=None
while IFS= read -r strategy; do
  name=${{strategy%% *}}
  if eval "${{strategy#* }} \\"\\$grading/model.diff\\"" >&2; then applied=$name; break; fi
  git reset --hard --quiet HEAD >&2 && git clean -fdxq >&2 \\
    || {{ echo "{result}: infra-error the tree could not be reset"; exit 0; }}
done <<'STRATEGIES'
{strategies}
STRATEGIES
echo "{strategy}: $applied"
[ "$applied" != None ] || {{ echo "{result}: patch-failed"; exit 0; }}
while IFS= read -r path; do
  [ -n "$path" ] || continue
  git checkout HEAD -- "$path" 2>/dev/null || rm -f -- "$path"
done < "$grading/protected.txt"
base=$(git rev-parse HEAD)
git checkout --quiet --detach "$base"
git for-each-ref --format='%(refname)' | while IFS= read -r ref; do git update-ref -d "$ref"; done
git stash clear; git reflog expire --expire=now --all; git gc --quiet --prune=now
echo "{result}: tests"
exec bash "$grading/eval.sh"
"""


def runner_script() -> str:
    """The bash runner: apply, reset the protected paths, cut history, run the eval script."""
    lines = "\n".join(f"{name} {shlex.join(command)}" for name, command in APPLY_STRATEGIES)
    return RUNNER.format(strategies=lines, strategy=STRATEGY, result=RESULT)


def grading_files(instance: SweInstance, patch: Patch, test_patch: Patch) -> dict[str, str]:
    """The ConfigMap's files: the runner, the patch, the paths to reset and the eval script."""
    protected = [path for path in patch.paths if is_protected(path) or path in test_patch.paths]
    return {
        "runner.sh": runner_script(),
        "model.diff": patch.text,
        "protected.txt": "".join(f"{path}\n" for path in protected),
        "eval.sh": official.with_test_exit_code(instance.eval_script),
    }


def _first(log: str, marker: str) -> tuple[str | None, str]:
    """The value of the first `marker:` line and the log after it (the runner prints before tests)."""
    _, found, rest = log.partition(f"{marker}: ")
    if not found:
        return None, log
    value, _, after = rest.partition("\n")
    return value.strip(), after


def grade_output(instance: SweInstance, log: str, rules: GradingRules, sandbox: str = "kubernetes") -> Grade:
    """Grade a pod's log: the runner's own lines first, then swebench's reading of the eval log."""
    strategy, rest = _first(log, STRATEGY)
    result, tests_log = _first(rest, RESULT)
    details: dict[str, Any] = {
        "patch_strategy": None if strategy in (None, "None") else strategy,
        "sandbox": sandbox,
        "grading": "official",
        "log_parser": official.test_spec(instance).log_parser,
        "durations": {},
        "log_tail": log[-LOG_TAIL_BYTES:],
    }
    if result == "patch-failed":
        details["reason"] = "no strategy applied the patch"
        return Grade(reward=0.0, resolved=False, outcome="patch-failed", details=details)
    if result != "tests":
        details["reason"] = f"the grading pod did not reach the tests ({result or 'no result line'})"
        return Grade(reward=0.0, outcome="infra-error", details=details)
    graded = official.grade_log(instance, tests_log)
    if graded.report is None:
        details["reason"] = "swebench found no valid test run in the log"
        return Grade(reward=0.0, resolved=False, outcome="inconsistent", details=details)
    report = graded.report
    details.update(
        tests={
            case: graded.statuses.get(case, "MISSING")
            for case in instance.fail_to_pass + instance.pass_to_pass
        },
        FAIL_TO_PASS={"success": report.f2p_success, "failure": report.f2p_failure},
        PASS_TO_PASS={"success": report.p2p_success, "failure": report.p2p_failure},
        f2p_rate=report.f2p_rate,
        p2p_rate=report.p2p_rate,
        resolution=report.resolution,
    )
    return Grade(reward=reward_of(report, rules), resolved=report.resolved, outcome="graded", details=details)
