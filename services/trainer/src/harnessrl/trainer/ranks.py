"""The trainer's ranks: rank 0 leads (it runs the service), the other ranks follow its engine calls.

Under `torchrun --nproc-per-node N` every rank builds the same `PolicyEngine`, and verl's worker is
collective: each train, infer, checkpoint and weight gather must be entered by every rank, in the
same order. Only the leader knows what comes next, so it announces every engine operation as a
`Command` before running it; a follower's loop (`RankChannel.follow`) receives the command and runs
the same operation with its own share, until `stop`. The rules:

- Commands travel on a gloo group of their own (object collectives on the CPU, on GPUs too), never
  on the groups verl trains on. Its timeout is long: followers idle while no rollouts arrive.
- The leader holds a lock from sending a command until its own part of the operation is done: the
  service calls the engine from worker threads, and two interleaved operations would pair the wrong
  collectives across ranks.
- Followers ignore SIGTERM and SIGINT (torchrun and a process-group signal reach every rank): a
  step in flight needs them, and the leader stops them once it has stopped. If the leader dies,
  torchrun ends the other ranks.
- An operation that fails on the leader after its command went out leaves the followers inside
  collectives the leader will never join: the channel is then broken, further commands raise
  `RankError` and `stop` sends nothing (the leader's process fails, torchrun ends the others).
- With one rank there is no group and no traffic: every call runs in place.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from harnessrl.shared.log import get_logger
from harnessrl.shared.net import free_port
from harnessrl.trainer.batch import RowBatch
from harnessrl.trainer.errors import TrainerError
from harnessrl.trainer.samples import TrainingRow

log = get_logger(__name__)
STOP = "stop"
# Followers wait for the next command this long before gloo gives up (idle runs stay up).
IDLE_TIMEOUT = timedelta(days=30)


class RankError(TrainerError):
    """The ranks cannot run an operation together (a rank is not the leader, or one failed)."""


class Command(msgspec.Struct, frozen=True):
    """One engine operation for one rank: its name and that rank's share of the work."""

    op: str
    share: Any = None


def launched_rank() -> int:
    """This process's rank as torchrun announced it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def ensure_process_group() -> None:
    """Join torchrun's process group, or start a world-size-1 gloo group on a free port.

    Under torchrun each rank takes the GPU of its `LOCAL_RANK` first (verl selects devices only
    under Ray). Outside torchrun the rendezvous variables are always overwritten: a child process
    inherits its parent's, and reusing the parent's port would collide with the parent's store.
    """
    if dist.is_initialized():
        return
    on_gpu = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        return
    port = free_port()
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def ignore_stop_signals() -> None:
    """A follower outlives SIGTERM/SIGINT: the leader finishes its step with it, then stops it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class RankChannel:
    """Commands from the leader to every follower, and results back (one per engine).

    Created collectively: every rank constructs it at the same point (it may create a group).
    """

    def __init__(self) -> None:
        self.rank: int = dist.get_rank()
        self.size: int = dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if self.size > 1 else None
        self._lock = threading.RLock()
        self._closed = ""

    @property
    def leads(self) -> bool:
        """Whether this rank runs the service and decides every operation."""
        return self.rank == 0

    @contextlib.contextmanager
    def command(self, op: str, shares: Sequence[Any]) -> Iterator[Any]:
        """Leader only: send `op` with `shares[r]` to rank r; yields the leader's own share.

        The block runs the leader's part of the operation; the next command waits for it.
        """
        if not self.leads:
            raise RankError(f"{op}: rank {self.rank} follows, only rank 0 sends commands")
        if len(shares) != self.size:
            raise ValueError(f"{op}: {len(shares)} shares for {self.size} ranks")
        with self._lock:
            if self._closed:
                raise RankError(f"{op}: {self._closed}")
            share = self._scatter([Command(op, share) for share in shares]).share
            try:
                yield share
            except BaseException:
                if self.size > 1:
                    self._closed = f"'{op}' failed on rank 0 while the other ranks ran it"
                raise

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank: `value` of each rank, in rank order, on the leader; None on followers."""
        if self._group is None:
            return [value]
        out: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(value, out, dst=0, group=self._group)
        return out

    def follow(self, handlers: Mapping[str, Callable[[Any], object]]) -> None:
        """Follower only: run each received command's handler with this rank's share, until `stop`."""
        if self.leads:
            raise RankError("rank 0 leads: it cannot follow")
        log.info("ranks.following", rank=self.rank, ranks=self.size)
        while (command := self._scatter(None)).op != STOP:
            handlers[command.op](command.share)
        log.info("ranks.stopped", rank=self.rank)

    def stop(self) -> None:
        """Leader only: end every follower's loop (idempotent; nothing to send with one rank).

        After a failed operation nothing is sent: the followers are not listening.
        """
        if not self.leads or self._closed or self.size == 1:
            return
        with self.command(STOP, [None] * self.size):
            self._closed = "the followers were stopped"

    def _scatter(self, commands: list[Command] | None) -> Command:
        """Rank r receives `commands[r]` (given on the leader only)."""
        if self._group is None:
            if commands is None:
                raise RankError("a single rank has no leader to receive from")
            return commands[0]
        received: list[Any] = [None]
        dist.scatter_object_list(received, commands, src=0, group=self._group)
        result: Command = received[0]
        return result


class TrainShare(msgspec.Struct, frozen=True):
    """One rank's part of a step.

    Its rows, the step (the seed), the step's real row count, and whether every rank trains one
    row per micro-batch (decided on the whole step, see `engine`).
    """

    batch: RowBatch
    step: int
    global_rows: int
    row_micro_batches: bool = False


class LogprobShare(msgspec.Struct, frozen=True):
    """One rank's part of a logprob read."""

    rows: list[TrainingRow]
    temperature: float
    reference: bool
    row_micro_batches: bool = False


class CheckpointShare(msgspec.Struct, frozen=True):
    """A checkpoint directory every rank writes its shard to (or reads it from)."""

    directory: str
    step: int = 0
