"""The JetStream implementation of `Bus` over nats-py: the client, its consumers and key-value buckets."""

from harnessrl.shared.bus.nats.client import NatsBus

__all__ = ["NatsBus"]
