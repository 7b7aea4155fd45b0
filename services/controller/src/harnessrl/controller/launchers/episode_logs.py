"""What a failed episode's logs say, cheaply: the last lines of its stderr."""

from __future__ import annotations

import os
from pathlib import Path

from harnessrl.shared.contracts import DETAIL_CHARS

# Bytes read from the end of the log: enough for `DETAIL_CHARS` characters of multi-byte text.
_READ_FACTOR = 4


def log_tail(path: Path, limit: int = DETAIL_CHARS) -> str:
    """The last whole lines of a log that fit in `limit` characters ("" when there is no log).

    Reads only the end of the file, however long the harness's output was.
    """
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - _READ_FACTOR * limit))
            text = log.read().decode(errors="replace").rstrip()
    except OSError:
        return ""
    if len(text) <= limit:
        return text
    text = text[-limit:]
    return text.partition("\n")[2] or text
