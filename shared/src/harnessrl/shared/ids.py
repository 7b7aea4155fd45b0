"""Identifiers: sortable, subject-safe, and deterministic where a business key exists."""

from __future__ import annotations

import hashlib
import os
import time


def new_id(prefix: str) -> str:
    """A fresh id: prefix, millisecond time (sortable) and 48 random bits; safe as a subject token."""
    return f"{prefix}-{int(time.time() * 1000):x}{os.urandom(6).hex()}"


def stable_id(prefix: str, *parts: object) -> str:
    """A deterministic id from a business key, so a replay produces the same id."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:20]
    return f"{prefix}-{digest}"
