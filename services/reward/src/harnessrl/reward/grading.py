"""How graders are found and built: the `harnessrl.graders` entry points, and nothing else.

Built-in graders and third-party ones register the same way (a name mapped to a class in the
entry point group), so one lookup serves both and `harnessrl.reward` installed is the registry.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import msgspec

from harnessrl.reward.errors import UnknownGraderError
from harnessrl.reward.graders.base import Grader, GradingContext
from harnessrl.reward.settings import GradingRules, RewardSettings, SandboxLimits
from harnessrl.reward.swe.sandbox import available_limits, missing_isolation
from harnessrl.shared.log import get_logger

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


_log = get_logger(__name__)


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
        container_engine=settings.container_engine,
        namespace=settings.namespace,
        kube_api_url=settings.kube_api_url,
    )


def local_sandbox(settings: RewardSettings) -> RewardSettings:
    """A local worker's settings asking for the sandbox this machine gives, and a warning of what it lacks.

    The reward service refuses to grade in a sandbox weaker than its settings ask for; a local run
    on a machine without (say) a privilege drop accepts that here, in the open, instead.
    """
    limits = grading_context(settings).limits
    python = settings.python or sys.executable
    missing = missing_isolation(limits, python)
    if not missing:
        return settings
    _log.warning("reward.sandbox_weaker", missing=missing)
    available = available_limits(limits, python)
    return msgspec.structs.replace(
        settings, isolate_network=available.isolate_network, drop_privileges=available.drop_privileges
    )
