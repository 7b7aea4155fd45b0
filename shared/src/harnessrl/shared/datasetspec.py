"""How a run reads its `tasks` path as a dataset as it ships: the `[dataset]` table of a run spec."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

# How a dataset's rows are read (see `harnessrl.controller.dataset_flavours`): `tasks` is our own
# row shape (TaskSpec rows, or SWE-bench rows with `repo_path` / `image`), `auto` detects the
# flavour from the rows' fields, the others are the SWE-bench family as each dataset ships.
DatasetFlavour = Literal[
    "auto", "tasks", "swe-bench", "swe-bench-multilingual", "swe-smith", "swe-gym", "r2e-gym", "swe-rebench"
]
DATASET_FLAVOURS: tuple[str, ...] = get_args(DatasetFlavour)


class DatasetSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How a run reads its `tasks` path as a dataset as it ships (JSONL, Parquet, a saved folder)."""

    flavour: DatasetFlavour = "auto"
    # The split to read where the dataset has several (None: its only one).
    split: str | None = None
    # Keep only rows whose instance id matches one of these globs (empty: every row) ...
    instances: list[str] = msgspec.field(default_factory=list)
    # ... and whose repository (`owner/name`) is one of these (empty: every repository).
    repos: list[str] = msgspec.field(default_factory=list)
    # At most this many rows, the first after filtering (None: all).
    limit: int | None = None
    # Pull every task image from this registry (a mirror) instead of the one its name says.
    image_prefix: str | None = None

    def __post_init__(self) -> None:
        """Reject values no dataset read could use, naming the field."""
        if self.limit is not None and self.limit < 1:
            raise msgspec.ValidationError("Expected `dataset.limit` >= 1")
        if self.image_prefix is not None and not self.image_prefix.strip("/"):
            raise msgspec.ValidationError("Expected `dataset.image_prefix` to name a registry")
        for name in ("instances", "repos"):
            if not all(getattr(self, name)):
                raise msgspec.ValidationError(f"Expected `dataset.{name}` without empty entries")
