"""Dataset files as they ship: rows of a JSONL file, a Parquet file, a Hugging Face folder or a saved one.

`read_source(path, split)` reads one split of:

- a JSONL file (one JSON object a line; any file that is not `.parquet` or `.arrow`);
- a Parquet file;
- a folder in the Hugging Face hub layout: Parquet (or JSONL) files anywhere under it, each named
  `<split>[-NNNNN-of-NNNNN[-hash]].parquet` (`data/test-00000-of-00001.parquet`) or, in the
  converted-Parquet layout, `<split>/0000.parquet` (the split is the folder's name);
- a folder written by `datasets.Dataset.save_to_disk` (`state.json` beside `data-*.arrow`) or
  `DatasetDict.save_to_disk` (`dataset_dict.json` naming the splits, one such folder per split).

Saved folders are read with pyarrow directly (Arrow IPC streams, the files `state.json` lists),
not with the `datasets` library: that would add 17 distributions (pandas, huggingface-hub, ...) to
the controller's image for a format pyarrow reads on its own.

A split that is not there is an error listing the splits that are; a dataset with several splits
and none asked for is an error too. Every row keeps where it came from (`file:line` or `file row N`)
for messages; a JSONL line that is not a JSON object is kept as a row with that `error`, so a check
can report it beside the others.
"""

from __future__ import annotations

import datetime
import decimal
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.controller.errors import DatasetError

# The hub's shard names: `test-00000-of-00001.parquet`, older ones with a hash after the count; in a
# folder a bare `test.parquet` names its split too.
_SHARD = re.compile(r"^(?P<split>[^.]+?)(?P<count>-\d{5}-of-\d{5}(?:-[0-9a-f]+)?)?$")
_DATA_SUFFIXES = (".parquet", ".jsonl")


@dataclass(frozen=True)
class SourceRow:
    """One row as read: its fields (empty when unreadable), where it is, and why it is unreadable."""

    where: str
    fields: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class Source:
    """The rows of one split of a dataset, and the splits the dataset has."""

    path: Path
    split: str | None
    splits: tuple[str, ...]
    rows: list[SourceRow]


def read_source(path: Path | str, split: str | None = None) -> Source:
    """Every row of `split` of the dataset at `path` (see the module docstring for the layouts)."""
    root = Path(path)
    if root.is_dir():
        return _read_folder(root, split)
    if not root.exists():
        raise DatasetError(f"cannot read tasks: {root} does not exist")
    own = _shard_split(root)
    splits = (own,) if own else ()
    if split is not None and split != own:
        raise DatasetError(f"{root} is a single file without split {split!r} (available: {_listed(splits)})")
    return Source(root, own, splits, list(_file_rows(root)))


def _read_folder(root: Path, split: str | None) -> Source:
    if (root / "dataset_dict.json").is_file():
        names = _saved_splits(root)
        chosen = _choose(root, split, names)
        return Source(root, chosen, names, list(_saved_rows(root / chosen)))
    if (root / "state.json").is_file():
        if split is not None:
            raise DatasetError(f"{root} is a saved dataset without splits; drop the split ({split!r})")
        return Source(root, None, (), list(_saved_rows(root)))
    files = _split_files(root)
    if not files:
        raise DatasetError(
            f"{root}: no dataset here: expected Parquet or JSONL files (the hub layout, "
            "data/<split>-00000-of-00001.parquet) or a folder written by save_to_disk"
        )
    chosen = _choose(root, split, tuple(sorted(files)))
    rows = [row for file in files[chosen] for row in _file_rows(file)]
    return Source(root, chosen, tuple(sorted(files)), rows)


def _choose(root: Path, split: str | None, splits: tuple[str, ...]) -> str:
    """The split to read: the one asked for, else the only one there is."""
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise DatasetError(f"{root} has splits {_listed(splits)}: name one (`dataset.split`, --split)")
    if split not in splits:
        raise DatasetError(f"{root} has no split {split!r}; available: {_listed(splits)}")
    return split


def _listed(splits: tuple[str, ...]) -> str:
    return ", ".join(splits) if splits else "none"


def _file_split(file: Path) -> str | None:
    """A data file's split in a hub folder: `test` for `test-00000-of-00001.parquet` or `test.jsonl`.

    In the converted-Parquet layout (`default/test/0000.parquet`) the folder names the split.
    """
    if file.stem.isdigit():
        return file.parent.name or None
    match = _SHARD.match(file.stem)
    return match.group("split") if match else None


def _shard_split(file: Path) -> str | None:
    """A lone file's split, only where its name is a hub shard's (`test-00000-of-00001.parquet`)."""
    match = _SHARD.match(file.stem)
    is_shard = file.suffix in _DATA_SUFFIXES and match is not None and match.group("count")
    return match.group("split") if is_shard and match else None


def _split_files(root: Path) -> dict[str, list[Path]]:
    """Every data file under `root` by split, in name order (shards read in their order)."""
    found: dict[str, list[Path]] = {}
    for file in sorted(p for p in root.rglob("*") if p.suffix in _DATA_SUFFIXES and p.is_file()):
        split = _file_split(file)
        if split:
            found.setdefault(split, []).append(file)
    return found


def _file_rows(file: Path) -> Iterator[SourceRow]:
    if file.suffix == ".parquet":
        return _parquet_rows(file)
    if file.suffix == ".arrow":
        return _arrow_rows(file)
    return _jsonl_rows(file)


def _jsonl_rows(file: Path) -> Iterator[SourceRow]:
    try:
        lines = file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read tasks file {file}: {getattr(exc, 'strerror', None) or exc}") from exc
    for number, line in enumerate(lines, start=1):
        if line.strip():
            yield _json_row(line, f"{file}:{number}")


def _json_row(line: str, where: str) -> SourceRow:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as exc:
        return SourceRow(where, {}, f"not JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return SourceRow(where, {}, "not JSON: nested too deeply")
    if not isinstance(fields, dict):
        return SourceRow(where, {}, f"expected a JSON object, got {type(fields).__name__}")
    return SourceRow(where, fields)


def _parquet_rows(file: Path) -> Iterator[SourceRow]:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read Parquet file {file}: {exc}") from exc
    return _table_rows(table, file)


def _arrow_rows(file: Path) -> Iterator[SourceRow]:
    """Rows of an Arrow IPC stream, the format `save_to_disk` writes its `data-*.arrow` files in."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(file)) as stream:
            table = pa.ipc.open_stream(stream).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read Arrow file {file}: {exc}") from exc
    return _table_rows(table, file)


def _table_rows(table: Any, file: Path) -> Iterator[SourceRow]:
    for number, fields in enumerate(table.to_pylist(), start=1):
        yield SourceRow(f"{file} row {number}", {str(k): _plain(v) for k, v in fields.items()})


def _plain(value: Any) -> Any:
    """A value as JSON would carry it: timestamps as ISO text, decimals as text, nested alike."""
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _saved_splits(root: Path) -> tuple[str, ...]:
    """The splits `DatasetDict.save_to_disk` recorded in `dataset_dict.json`."""
    meta = _json_file(root / "dataset_dict.json")
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DatasetError(f"{root / 'dataset_dict.json'}: `splits` is not a list of split names")
    return tuple(splits)


def _saved_rows(folder: Path) -> Iterator[SourceRow]:
    """Rows of one `Dataset.save_to_disk` folder: the Arrow files its `state.json` lists, in order."""
    state = _json_file(folder / "state.json")
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if isinstance(listed, list) and listed:
        names = [str(entry.get("filename", "")) for entry in listed if isinstance(entry, dict)]
    else:
        names = sorted(p.name for p in folder.glob("data-*.arrow"))
    if not names:
        raise DatasetError(f"{folder}: a saved dataset without data files (state.json lists none)")
    strays = [name for name in names if Path(name).name != name or name in ("", ".", "..")]
    if strays:
        raise DatasetError(f"{folder / 'state.json'}: data file {strays[0]!r} is not a file in this folder")
    for name in names:
        yield from _arrow_rows(folder / name)


def _json_file(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except OSError as exc:
        raise DatasetError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}: not JSON: {exc.msg}") from exc
