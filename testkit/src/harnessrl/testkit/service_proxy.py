"""The stand-in for kube-proxy: one container per ClusterIP Service, forwarding each connection.

A Service's DNS names belong to this proxy's container (not to the pods), and every new TCP
connection goes to one of the Service's pods drawn at random, as kube-proxy's iptables mode spreads
connections over a Service's endpoints; a pod that does not answer is skipped for the next one.
Random, not in turn: an episode opens two connections (its calls, then its artifact upload), and
when episodes run one after another a strict turn sends every episode's calls to the same pod.

Like kube-proxy, which knows endpoints by address, it dials each pod at the address it is given and
looks the pod's name up only when that address stops answering (a restarted pod may come back
elsewhere). podman's DNS is slow on a loaded machine: when the proxy looked every name up, one
cluster check sent all 49 connections to one gateway pod because the other's lookups timed out.

It uses only the standard library, so it runs in any image with python3:

    python3 service_proxy.py '{"listeners": [{"port": 80, "backends": [["pod-a", 8000, "10.89.0.5"], ...]}]}'

An empty address (`["pod-a", 8000, ""]`) has the proxy look the name up on first use. Each accepted
connection is logged as one line (`connect <port> -> <host>:<port>`) and each skipped pod as one
(`skip <port> -> <host>:<port>: <why>`), which is how a check sees the spread.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
from collections.abc import Sequence
from typing import Any

CONNECT_TIMEOUT_S = 3.0
# How long a connection waits for some backend to answer, and how often it tries the round again.
PATIENCE_S, RETRY_S = 10.0, 0.25
CHUNK = 65536


def _log(line: str) -> None:
    """One line of the container's log (what `podman logs` shows)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction; at its end pass the half-close on (the other direction may go on)."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()  # the other side went away: the connection ends, as kube-proxy's would


async def _dial(address: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection to `address`, or None if it refuses or does not answer in time."""
    try:
        return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):
        return None


class Listener:
    """One Service port: each connection to a backend drawn at random, the others tried after it."""

    def __init__(self, port: int, backends: Sequence[tuple[str, int, str]]) -> None:
        """`backends`: each pod's name, port and address ("" to look the name up on first use)."""
        self.port = port
        self.backends = [(host, port) for host, port, _ in backends]
        self._draw = random.Random()  # noqa: S311 - load spreading, not security
        # Each pod's address: as given, then wherever its name last resolved to a pod that answered.
        # A name lookup failing or timing out must not refuse a connection to a pod that is up.
        self._addresses = {host: address for host, _, address in backends if address}

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to one pod: at the address it last had, else at the one its name resolves to.

        Names are looked up only when needed: a lookup that hangs holds one of the few resolver
        threads, and many of them at once stall every connection behind them.
        """
        known = self._addresses.get(host)
        # A pod that no longer answers at its old address may have come back at another one.
        opened = await _dial(known, port) if known is not None else None
        if opened is None:
            found = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT_S
            )
            address = str(found[0][4][0])
            opened = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
            self._addresses[host] = address
        return opened

    async def _connect(self) -> tuple[str, int, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A backend that answers: a random one first, then the ones after it; None if none does."""
        first = self._draw.randrange(len(self.backends))
        for offset in range(len(self.backends)):
            host, port = self.backends[(first + offset) % len(self.backends)]
            try:
                up_reader, up_writer = await self._open(host, port)
            except (OSError, TimeoutError) as error:
                _log(f"skip {self.port} -> {host}:{port}: {type(error).__name__} {error}")
                continue
            return host, port, up_reader, up_writer
        return None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Connect to the next backend that answers and pipe both ways; close if none does in time.

        While no backend answers, the round is tried again for `PATIENCE_S` (pods restarting), so
        only a Service with no live pod for that long refuses a connection.
        """
        deadline = asyncio.get_running_loop().time() + PATIENCE_S
        while (upstream := await self._connect()) is None:
            if asyncio.get_running_loop().time() >= deadline:
                _log(f"refused {self.port}: no backend answered")
                writer.close()
                return
            await asyncio.sleep(RETRY_S)
        host, port, up_reader, up_writer = upstream
        _log(f"connect {self.port} -> {host}:{port}")
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        up_writer.close()
        writer.close()


def spread(log: str) -> dict[str, Any]:
    """What a proxy's log says of its spread.

    Per pod: connections and skipped dials (with the first skip's reason); and the connections
    refused because no pod answered.
    """
    found: dict[str, Any] = {"refused": 0, "connections": {}, "skipped": {}, "first_skip": {}}
    for line in log.splitlines():
        if line.startswith("connect "):
            pod = line.rsplit(" -> ", 1)[1]
            found["connections"][pod] = found["connections"].get(pod, 0) + 1
        elif line.startswith("skip "):
            pod, why = line.split(" -> ", 1)[1].split(": ", 1)
            found["skipped"][pod] = found["skipped"].get(pod, 0) + 1
            found["first_skip"].setdefault(pod, why[:200])
        found["refused"] += line.startswith("refused ")
    return found


async def serve(config: dict[str, Any]) -> None:
    """Listen on every configured port until the container stops."""
    servers = []
    for item in config["listeners"]:
        backends = [(str(host), int(port), str(address)) for host, port, address in item["backends"]]
        listener = Listener(int(item["port"]), backends)
        servers.append(await asyncio.start_server(listener.handle, "0.0.0.0", listener.port))  # noqa: S104 - the Service's address
    _log(f"serving {[item['port'] for item in config['listeners']]}")
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
