"""Blobs in JetStream object stores (a bucket is created, at the bus's replica count, on first use)."""

from __future__ import annotations

from typing import Any

import nats.js.errors
from nats.js import JetStreamContext, api


async def put_object(js: JetStreamContext, bucket: str, name: str, data: bytes, replicas: int) -> None:
    """Store a blob (chunked by the object store)."""
    store = await _object_store(js, bucket, replicas)
    await store.put(name, data)


async def get_object(js: JetStreamContext, bucket: str, name: str, replicas: int) -> bytes:
    """Read a blob; `KeyError` when absent."""
    store = await _object_store(js, bucket, replicas)
    try:
        result = await store.get(name)
    except nats.js.errors.NotFoundError as exc:
        raise KeyError(name) from exc
    return bytes(result.data or b"")


async def _object_store(js: JetStreamContext, bucket: str, replicas: int) -> Any:
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(bucket, api.ObjectStoreConfig(replicas=replicas))
