"""How graders are found and built: the `harnessrl.graders` entry points, and nothing else.

Built-in graders and third-party ones register the same way (a name mapped to a class in the
entry point group), so one lookup serves both and `harnessrl.reward` installed is the registry.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from harnessrl.reward.errors import UnknownGraderError
from harnessrl.reward.graders.base import Grader, GradingContext
from harnessrl.reward.settings import GradingRules, RewardSettings, SandboxLimits

GRADER_GROUP = "harnessrl.graders"


def grader_names() -> list[str]:
    """Every registered grader name, sorted."""
    return sorted({entry.name for entry in entry_points(group=GRADER_GROUP)})


def grader_class(name: str) -> type:
    """The class registered as `name` in the `harnessrl.graders` entry points."""
    found = entry_points(group=GRADER_GROUP, name=name)
    if not found:
        known = ", ".join(grader_names()) or "none"
        raise UnknownGraderError(f"no grader named {name!r} is registered (known: {known})")
    loaded = next(iter(found)).load()
    if not isinstance(loaded, type):
        raise UnknownGraderError(f"entry point {name!r} is not a class")
    return loaded


def build_grader(name: str, context: GradingContext) -> Grader:
    """Instantiate the grader `name` for `context`."""
    cls = grader_class(name)
    factory = getattr(cls, "from_context", None)
    grader = factory(context) if callable(factory) else cls()
    if not callable(getattr(grader, "grade", None)):
        raise UnknownGraderError(f"grader {name!r} has no grade method")
    return grader  # type: ignore[no-any-return]


def grading_context(settings: RewardSettings) -> GradingContext:
    """The part of the service's settings that graders see."""
    return GradingContext(
        tasks_root=settings.tasks_root,
        python=settings.python or sys.executable,
        limits=SandboxLimits(
            timeout_s=settings.test_timeout_s,
            memory_bytes=settings.memory_bytes,
            isolate_network=settings.isolate_network,
            drop_privileges=settings.drop_privileges,
        ),
        rules=GradingRules(
            xfail_passes_f2p=settings.xfail_passes_f2p, partial_credit=settings.partial_credit
        ),
        max_artifact_bytes=settings.max_artifact_bytes,
        sandbox=settings.sandbox,
        namespace=settings.namespace,
    )
