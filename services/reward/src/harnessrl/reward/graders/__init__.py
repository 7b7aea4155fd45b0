"""Built-in graders: exact, regex and numeric answers, and SWE-bench patches."""

from harnessrl.reward.graders.simple import ExactGrader, NumericGrader, RegexGrader
from harnessrl.reward.graders.swebench import SweBenchGrader

BUILTIN_GRADERS: dict[str, type] = {
    "exact": ExactGrader,
    "regex": RegexGrader,
    "numeric": NumericGrader,
    "swebench": SweBenchGrader,
}

__all__ = ["BUILTIN_GRADERS", "ExactGrader", "NumericGrader", "RegexGrader", "SweBenchGrader"]
