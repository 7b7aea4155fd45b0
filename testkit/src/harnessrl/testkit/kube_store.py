"""The state behind the fake Kubernetes API: objects, resourceVersions, history and watchers.

Semantics follow the real API server where the controller depends on them: one cluster-wide
resourceVersion counter, uid per object, `409 AlreadyExists`, `404 NotFound`, label selectors, watch
streams that replay history after a resourceVersion and answer `410 Gone` once it was compacted.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import uuid
from collections import Counter
from typing import Any

import msgspec


class ApiStatusError(Exception):
    """An API error answered as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        """The `Status` body the API server sends."""
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


class WatchEvent(msgspec.Struct, frozen=True):
    """One change of one object."""

    rv: int
    plural: str
    namespace: str
    type: str
    obj: dict[str, Any]


def timestamp() -> str:
    """RFC 3339 UTC time as the API server writes it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


# The field selectors every kind supports; the real server refuses any other with 400.
FIELDS = ("metadata.name", "metadata.namespace")


def check_fields(fields: str) -> None:
    """Refuse a field selector on a field this server (like the API server for most) can't select."""
    for term in filter(None, (t.strip() for t in fields.split(","))):
        name = term.replace("!=", "=").split("=", 1)[0]
        if name not in FIELDS:
            raise ApiStatusError(400, "BadRequest", f'field label not supported: "{name}"')


def matches(obj: dict[str, Any], selector: str, fields: str = "") -> bool:
    """Whether an object matches a label selector and a field selector."""
    meta = obj.get("metadata", {})
    values = {"metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", "")}
    return selector_matches(selector, meta.get("labels") or {}) and selector_matches(fields, values)


class Watcher:
    """A live watch: a queue of events matching one plural, namespace and selectors."""

    def __init__(self, plural: str, namespace: str, selector: str, fields: str = "") -> None:
        self.plural, self.namespace, self.selector, self.fields = plural, namespace, selector, fields
        self.queue: asyncio.Queue[WatchEvent] = asyncio.Queue()

    def wants(self, event: WatchEvent) -> bool:
        """Whether the event belongs to this watch."""
        return (
            event.plural == self.plural
            and event.namespace == self.namespace
            and matches(event.obj, self.selector, self.fields)
        )


class ObjectStore:
    """Every object of the fake cluster, keyed by (plural, namespace, name)."""

    def __init__(self) -> None:
        self.rv = 0
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[WatchEvent] = []
        self.compacted_rv = 0
        self.watchers: set[Watcher] = set()
        self.creates: Counter[str] = Counter()
        self.conflicts: Counter[str] = Counter()

    def _bump(self, plural: str, namespace: str, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        event = WatchEvent(self.rv, plural, namespace, kind, copy.deepcopy(obj))
        self.history.append(event)
        for watcher in self.watchers:
            if watcher.wants(event):
                watcher.queue.put_nowait(event)

    def create(self, plural: str, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a new object; 409 when the name is taken."""
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiStatusError(422, "Invalid", f"{plural}: metadata.name is required")
        key = (plural, namespace, name)
        if key in self.objects:
            self.conflicts[f"{plural}/{name}"] += 1
            raise ApiStatusError(409, "AlreadyExists", f'{plural} "{name}" already exists')
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=timestamp())
        meta["generation"] = 1
        self.objects[key] = obj
        self.creates[f"{plural}/{name}"] += 1
        self._bump(plural, namespace, "ADDED", obj)
        return obj

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        """One object; 404 when absent."""
        try:
            return self.objects[(plural, namespace, name)]
        except KeyError:
            raise ApiStatusError(404, "NotFound", f'{plural} "{name}" not found') from None

    def modified(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Record that `obj` (already stored) changed."""
        self._bump(plural, obj["metadata"]["namespace"], "MODIFIED", obj)
        return obj

    def delete(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        """Remove an object; 404 when absent."""
        obj = self.get(plural, namespace, name)
        del self.objects[(plural, namespace, name)]
        self._bump(plural, namespace, "DELETED", obj)
        return obj

    def select(self, plural: str, namespace: str, selector: str, fields: str = "") -> list[dict[str, Any]]:
        """Objects of a plural in a namespace matching a label selector and a field selector."""
        return [
            obj
            for (p, ns, _), obj in self.objects.items()
            if p == plural and ns == namespace and matches(obj, selector, fields)
        ]

    def since(self, watcher: Watcher, rv: int) -> list[WatchEvent]:
        """Stored events after `rv` for a new watch; 410 when `rv` was compacted away."""
        if rv < self.compacted_rv:
            raise ApiStatusError(410, "Expired", f"too old resource version: {rv} ({self.compacted_rv})")
        return [e for e in self.history if e.rv > rv and watcher.wants(e)]

    def end_watches(self) -> None:
        """End every open watch stream (the server is shutting down)."""
        for watcher in self.watchers:
            watcher.queue.put_nowait(WatchEvent(self.rv, "", "", "CLOSE", {}))

    def compact(self) -> None:
        """Forget history: watches from an older resourceVersion now get 410 Gone."""
        self.compacted_rv = self.rv
        self.history.clear()
