"""Checkpoint directories, the trainer state and the atomic `latest` pointer.

Layout under the run's checkpoint root:

    step-000012/
      hf/                  HF safetensors + config + tokenizer: what vLLM reloads
      engine/              verl's engine state (model, optimizer, RNG) to resume training
      trainer_state.json   step, version, recently trained rollout ids, published flag
    step-000013/
      trainer_state.json   a step that trained nothing: its state only, `weights_step` 12
    latest                 "step-000013", replaced atomically after the step directory is complete
    dropped.json           ids of rollouts recently dropped (stale, incomplete, degenerate group):
                           settled without a step, so they live beside the step directories

Settled ids are kept by the version that was current when they settled, and only for the versions
a redelivered rollout could still train at (`Trainer.settle_window`): an older rollout is stale by
then, so the staleness filter drops it without a lookup. State stays bounded however long a run is.

A step directory is written under a temporary name and renamed into place, then `latest` is
replaced with `os.replace`; a crash at any point leaves the previous checkpoint intact and
`latest` pointing at a complete directory.

A step that trained nothing writes no weights: its state names the step directory that holds the
current version's (`weights_step`), and pruning keeps that directory however many such steps follow.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import msgspec

LATEST = "latest"
STATE_FILE = "trainer_state.json"
DROPPED_FILE = "dropped.json"


class TrainerState(msgspec.Struct, kw_only=True):
    """What a restart needs beyond the weights: where training stood and what it consumed."""

    run: str
    step: int = 0
    version: int = 0
    # Rollouts trained at each recent version: acked on redelivery, never trained again.
    trained: dict[int, list[str]] = msgspec.field(default_factory=dict)
    # Whether this step's WeightVersion was published (a restart publishes it if not).
    published: bool = False
    # The step whose directory holds the weights of `version` (hf/, engine/); 0: the base model.
    # A step that trained nothing keeps the previous one: it made no weights of its own.
    weights_step: int = 0
    # sha256 of the weights of `version` ("" before the first step), announced with each step.
    digest: str = ""
    # Data-parallel ranks that wrote the engine checkpoint (verl's shards are per rank).
    ranks: int = 1

    @property
    def carries_previous(self) -> bool:
        """Whether this step trained nothing and so serves the previous step's weights."""
        return self.step > 0 and self.weights_step != self.step


class CheckpointStore:
    """Step directories under `root` and the `latest` pointer."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def step_name(step: int) -> str:
        """The directory name of `step`."""
        return f"step-{step:06d}"

    def latest(self) -> Path | None:
        """The directory `latest` points at, or None before the first checkpoint."""
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        return self.root / pointer.read_text().strip()

    def load_state(self, run: str) -> TrainerState:
        """The latest checkpoint's state, or a fresh one."""
        directory = self.latest()
        if directory is None:
            return TrainerState(run=run)
        state = msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=TrainerState)
        if state.version and not state.weights_step:
            state.weights_step = state.step  # written before `weights_step`: every step had weights
        return state

    def weights_dir(self, state: TrainerState) -> Path | None:
        """The step directory holding the weights of `state` (hf/, engine/), None for the base model."""
        return self.root / self.step_name(state.weights_step) if state.weights_step else None

    def staging(self, step: int) -> Path:
        """An empty temporary directory to write step `step` into before `commit`."""
        path = self.root / f".{self.step_name(step)}.tmp"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, state: TrainerState) -> Path:
        """Write the state, move `staging` into place, then point `latest` at it."""
        _write_atomic(staging / STATE_FILE, msgspec.json.encode(state))
        final = self.root / self.step_name(state.step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _write_atomic(self.root / LATEST, final.name.encode())
        weights = self.weights_dir(state)
        self._prune({final.name, *([weights.name] if weights is not None else [])})
        return final

    def mark_published(self, state: TrainerState) -> None:
        """Record in the latest checkpoint that its version was published."""
        directory = self.latest()
        if directory is None:
            raise FileNotFoundError("no checkpoint to mark")
        state.published = True
        _write_atomic(directory / STATE_FILE, msgspec.json.encode(state))

    def load_dropped(self) -> dict[int, list[str]]:
        """Ids of recently dropped rollouts by the version current when they were dropped."""
        path = self.root / DROPPED_FILE
        if not path.exists():
            return {}
        return msgspec.json.decode(path.read_bytes(), type=dict[int, list[str]])

    def add_dropped(self, version: int, ids: list[str]) -> None:
        """Persist more dropped rollout ids (atomically rewrites the file)."""
        if ids:
            dropped = self.load_dropped()
            dropped[version] = [*dropped.get(version, []), *ids]
            _write_atomic(self.root / DROPPED_FILE, msgspec.json.encode(dropped))

    def forget_dropped_before(self, version: int) -> None:
        """Drop the ids dropped at versions before `version` (they are stale for good)."""
        dropped = self.load_dropped()
        kept = {v: ids for v, ids in dropped.items() if v >= version}
        if kept != dropped:
            _write_atomic(self.root / DROPPED_FILE, msgspec.json.encode(kept))

    def _prune(self, needed: set[str]) -> None:
        """Remove all but the newest `keep` step directories, never one in `needed`."""
        steps = sorted(path.name for path in self.root.glob("step-*") if path.is_dir())
        for name in steps[: max(len(steps) - self.keep, 0)]:
            if name not in needed:
                shutil.rmtree(self.root / name, ignore_errors=True)


def weights_digest(hf_dir: Path) -> str:
    """sha256 of the checkpoint's safetensors files, so a consumer can verify what it loads."""
    digest = hashlib.sha256()
    for path in sorted(hf_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file, fsync, rename: readers see the old or the new bytes."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
