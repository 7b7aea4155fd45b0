"""Reading a service's `/metrics` the way Prometheus does."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Every sample, keyed by name and its labels sorted.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """Every sample `url` serves (fetched off the event loop), in Prometheus' text format."""

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a test's own URL
            kind = response.headers["Content-Type"]
            if not kind.startswith("text/plain; version=0.0.4"):
                raise AssertionError(f"{url} answered {kind}, not Prometheus' text format")
            return str(response.read().decode())

    text = await asyncio.to_thread(fetch)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
