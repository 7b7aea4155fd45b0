"""Default addresses and ports every process agrees on, and free-port lookups on this machine."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.parse
from collections.abc import Sequence

NATS_PORT = 4222
DEFAULT_NATS_URL = f"nats://127.0.0.1:{NATS_PORT}"
# vLLM (uvicorn) closes an idle keep-alive connection after 5 s; its clients reuse one for less.
VLLM_CLIENT_KEEPALIVE_S = 4.0
# vLLM's `--tool-call-parser` unless told otherwise (Qwen/Hermes models); the gateway's token-in
# mode parses sampled text with the same one (its `tool_parser` setting).
VLLM_TOOL_CALL_PARSER = "hermes"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_free(port: int) -> bool:
    """True when nothing listens on `port` at 127.0.0.1."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class NatsUnreachable(ConnectionError):
    """No NATS server answers at a URL; the message is meant for a person."""


def nats_servers(url: str | Sequence[str]) -> list[str]:
    """Every server of a NATS URL list: a comma-separated string (as settings carry it) or a list.

    A cluster's clients take all of its nodes, so a node that dies is only a reconnect away.
    """
    parts = url.split(",") if isinstance(url, str) else list(url)
    servers = [part.strip() for part in parts if part.strip()]
    if not servers:
        raise NatsUnreachable(f"no NATS server in {url!r}")
    return servers


def nats_addresses(url: str) -> list[tuple[str, int]]:
    """The host and port of each server in a comma-separated NATS URL list."""
    addresses = []
    for server in nats_servers(url):
        try:
            parts = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
            addresses.append((parts.hostname or "127.0.0.1", parts.port or NATS_PORT))
        except ValueError:
            raise NatsUnreachable(f"{server!r} is not a NATS URL (nats://host:port)") from None
    return addresses


async def probe_nats(url: str, timeout_s: float = 5.0) -> None:
    """Fail fast when no server of `url` accepts a connection (the bus client would keep retrying).

    Right for a person who mistyped a URL; a service waiting for its deployment uses the client's
    own reconnect instead.
    """
    failures = []
    for host, port in nats_addresses(url):
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except TimeoutError:
            failures.append(f"{host}:{port}: no answer in {timeout_s:.0f} s")
            continue
        except OSError as exc:
            failures.append(f"{host}:{port}: {os.strerror(exc.errno) if exc.errno else exc}")
            continue
        writer.close()
        return
    raise NatsUnreachable(f"cannot connect to NATS at {url} ({'; '.join(failures)})")
