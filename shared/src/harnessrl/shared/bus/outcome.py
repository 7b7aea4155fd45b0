"""How a handler's outcome settles a message; shared by the JetStream and in-memory buses."""

from __future__ import annotations

from typing import Protocol

from harnessrl.shared.bus.base import Delivery, Handler, PermanentError, TransientError
from harnessrl.shared.contracts import ContractError
from harnessrl.shared.log import get_logger

log = get_logger(__name__)


class Settler(Protocol):
    """The acknowledgement primitives of one delivered message."""

    async def ack(self) -> None:
        """Done: never deliver again."""

    async def nak(self, delay: float) -> None:
        """Deliver again after `delay` seconds."""

    async def term(self, reason: str) -> None:
        """Copy to the dead-letter subject, then never deliver again."""


async def settle(delivery: Delivery, handler: Handler, max_deliver: int, settler: Settler) -> str:
    """Run `handler` and settle the message; returns "ack", "nak" or "term".

    A transient failure on the last allowed delivery is dead-lettered too, so a message is never
    dropped silently when redeliveries run out.
    """
    try:
        await handler(delivery)
    except (PermanentError, ContractError) as exc:
        log.warning("message.terminated", subject=delivery.subject, error=str(exc))
        await settler.term(f"{type(exc).__name__}: {exc}")
        return "term"
    except TransientError as exc:
        return await _retry(delivery, max_deliver, settler, exc.delay, str(exc))
    except Exception as exc:
        log.exception("handler.crashed", subject=delivery.subject)
        return await _retry(delivery, max_deliver, settler, 1.0, repr(exc))
    await settler.ack()
    return "ack"


async def _retry(delivery: Delivery, max_deliver: int, settler: Settler, delay: float, reason: str) -> str:
    if max_deliver > 0 and delivery.num_delivered >= max_deliver:
        log.warning("message.redeliveries_exhausted", subject=delivery.subject, reason=reason)
        await settler.term(f"redeliveries exhausted: {reason}")
        return "term"
    await settler.nak(delay)
    return "nak"
