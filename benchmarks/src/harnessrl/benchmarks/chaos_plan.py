"""The chaos run's faults: a seeded plan of kills -9, and what the trainer checkpointed as trained.

`plan` draws, from the seed alone, which kind of process dies at which point of the run (a count
of answered calls) and how long it stays down, so a seed names one repeatable sequence of faults.
Each kind (a NATS node, a gateway replica, the active controller, a reward worker, the trainer)
comes up in turn before any repeats, shuffled. The victim among several of a kind is drawn from the
same generator when the kill happens.

`TrainedLedger` reads every trainer checkpoint it sees while the run goes on: a state lists the
rollouts trained at each recent version, so one rollout under two versions (or twice under one)
was trained twice.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import msgspec

KINDS = ("nats", "gateway", "controller", "reward", "trainer")
# Kills fall inside this share of the planned calls: after start-up, before the last batch.
WINDOW = (0.05, 0.85)


class Kill(msgspec.Struct, frozen=True, kw_only=True):
    """One planned fault: kill a process of `kind` -9 once `at_calls` calls were answered."""

    kind: str
    at_calls: int
    down_s: float


def plan(seed: int, kills: int, calls: int, down_s: tuple[float, float]) -> list[Kill]:
    """`kills` faults drawn from `seed`: every kind in turn (shuffled), at sorted random call counts."""
    rng = random.Random(seed)  # noqa: S311 - a repeatable plan, not a secret
    kinds: list[str] = []
    while len(kinds) < kills:
        rounds = list(KINDS)
        rng.shuffle(rounds)
        kinds += rounds
    points = sorted(int(calls * rng.uniform(*WINDOW)) for _ in range(kills))
    return [
        Kill(kind=kind, at_calls=at, down_s=round(rng.uniform(*down_s), 2))
        for kind, at in zip(kinds[:kills], points, strict=True)
    ]


class TrainedLedger:
    """Rollout ids trained at each version, as the checkpoints under `root` recorded them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.by_version: dict[int, set[str]] = defaultdict(set)
        self.twice: set[str] = set()  # trained twice under one version (seen in a single state)
        self._seen: set[tuple[Path, int]] = set()

    def read(self) -> None:
        """Take in every step's state not read yet (a step directory is complete once committed)."""
        for state in sorted(self.root.glob("step-*/trainer_state.json")):
            try:
                seen = (state, state.stat().st_mtime_ns)
                if seen in self._seen:
                    continue
                trained = msgspec.json.decode(state.read_bytes())["trained"]
            except (OSError, msgspec.DecodeError, KeyError):
                continue  # pruned or replaced meanwhile: a later state lists the same ids
            self._seen.add(seen)
            for version, ids in trained.items():
                self.twice |= {rollout for rollout in ids if ids.count(rollout) > 1}
                self.by_version[int(version)] |= set(ids)

    def trained_twice(self) -> int:
        """Rollouts trained under more than one version, or twice under one."""
        versions: dict[str, int] = defaultdict(int)
        for ids in self.by_version.values():
            for rollout in ids:
                versions[rollout] += 1
        return len(self.twice | {rollout for rollout, count in versions.items() if count > 1})

    def steps_seen(self) -> int:
        """Step states read so far (grows with every checkpoint)."""
        return len(self._seen)

    def trained(self) -> int:
        """Distinct rollouts trained."""
        return len(set().union(*self.by_version.values())) if self.by_version else 0
