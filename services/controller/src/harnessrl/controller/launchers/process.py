"""Facts about a local harness process that survive a controller restart (pid reuse included)."""

from __future__ import annotations

import msgspec

from harnessrl.shared.process import proc_stat


class ProcessFacts(msgspec.Struct, frozen=True, kw_only=True):
    """A process identified by pid and kernel start time, with its episode deadline."""

    pid: int
    start_ticks: int
    deadline: float


def process_facts(pid: int, deadline: float) -> ProcessFacts:
    """Record a just-started process."""
    fields = proc_stat(pid)
    return ProcessFacts(pid=pid, start_ticks=int(fields[19]) if fields else 0, deadline=deadline)


def alive(facts: ProcessFacts) -> bool:
    """Whether the recorded process still runs (not a zombie, not a reused pid)."""
    fields = proc_stat(facts.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return int(fields[19]) == facts.start_ticks
