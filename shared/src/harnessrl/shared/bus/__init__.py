"""The message bus: one interface, a JetStream implementation and an in-memory twin."""

from harnessrl.shared.bus.base import (
    Backlog,
    Bus,
    BusError,
    ConsumerSpec,
    Delivery,
    Handler,
    KeyExistsError,
    KeyValue,
    KvEntry,
    Outgoing,
    PermanentError,
    PubAck,
    PublishError,
    RevisionMismatchError,
    StreamDriftError,
    Subscription,
    TransientError,
    stop_all,
)
from harnessrl.shared.bus.memory import MemoryBus
from harnessrl.shared.bus.nats import NatsBus

__all__ = [
    "Backlog",
    "Bus",
    "BusError",
    "ConsumerSpec",
    "Delivery",
    "Handler",
    "KeyExistsError",
    "KeyValue",
    "KvEntry",
    "MemoryBus",
    "NatsBus",
    "Outgoing",
    "PermanentError",
    "PubAck",
    "PublishError",
    "RevisionMismatchError",
    "StreamDriftError",
    "Subscription",
    "TransientError",
    "stop_all",
]
