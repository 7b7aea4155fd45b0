"""Facts about a local harness process that survive a controller restart (pid reuse included)."""

from __future__ import annotations

from pathlib import Path

import msgspec


class ProcessFacts(msgspec.Struct, frozen=True, kw_only=True):
    """A process identified by pid and kernel start time, with its episode deadline."""

    pid: int
    start_ticks: int
    deadline: float


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; everything after its ')' splits cleanly.
    return raw[raw.rindex(")") + 2 :].split()


def process_facts(pid: int, deadline: float) -> ProcessFacts:
    """Record a just-started process."""
    fields = _stat_fields(pid)
    return ProcessFacts(pid=pid, start_ticks=int(fields[19]) if fields else 0, deadline=deadline)


def alive(facts: ProcessFacts) -> bool:
    """Whether the recorded process still runs (not a zombie, not a reused pid)."""
    fields = _stat_fields(facts.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return int(fields[19]) == facts.start_ticks
