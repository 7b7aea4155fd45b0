"""A list-then-watch loop over one kind of object, run in a thread with the blocking client.

It keeps the last resourceVersion it saw (from events and bookmarks) and resumes from it when the
server ends a watch at `timeoutSeconds`; `410 Gone` (an ERROR event or an HTTP 410) makes it relist.
Every object it sees, from a list or an event, goes to `emit(event_type, object)`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from harnessrl.shared.log import get_logger

Emit = Callable[[str, dict[str, Any]], None]
_GONE = 410
_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class ObjectWatch:
    """Follows every object a list function returns for `selector`, until `stop()`."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        namespace: str,
        selector: str,
        emit: Emit,
        *,
        timeout_s: int,
    ) -> None:
        self._name, self._list, self._ns, self._selector = name, list_fn, namespace, selector
        self._emit, self._timeout = emit, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._log = get_logger(__name__, kind=name)
        self.resource_version: str | None = None
        self.relists = 0

    def start(self) -> None:
        """Start the watch thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (at the latest when the current watch request ends)."""
        self._stop.set()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._relist()
                self._watch_once()
                failures = 0
            except ApiException as exc:
                if exc.status == _GONE:
                    self.resource_version = None
                    continue
                failures = self._back_off(failures, f"{exc.status} {exc.reason}")
            except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                failures = self._back_off(failures, str(exc))

    def _back_off(self, failures: int, error: str) -> int:
        delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
        self._log.warning("watch.retrying", error=error, delay_s=delay)
        self._stop.wait(delay)
        return failures + 1

    def _relist(self) -> None:
        response = self._list(self._ns, label_selector=self._selector, _preload_content=False)
        body = json.loads(response.data)
        self.relists += 1
        for item in body.get("items") or []:
            self._emit("SYNC", item)
        self.resource_version = body["metadata"]["resourceVersion"]

    def _watch_once(self) -> None:
        response = self._list(
            self._ns,
            label_selector=self._selector,
            watch=True,
            resource_version=self.resource_version,
            timeout_seconds=self._timeout,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=(5, self._timeout + 10),
        )
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    return
                self._handle(json.loads(line))
        finally:
            response.release_conn()

    def _handle(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            code = int(obj.get("code") or 500)
            raise ApiException(status=code, reason=obj.get("message", "watch error"))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self.resource_version = version
        if kind != "BOOKMARK":
            self._emit(str(kind), obj)


def wait_started(watch: ObjectWatch, timeout_s: float = 10.0) -> bool:
    """Block until the first list finished (tests and start-up use it to avoid races)."""
    end = time.monotonic() + timeout_s
    while watch.resource_version is None and time.monotonic() < end:
        time.sleep(0.01)
    return watch.resource_version is not None
