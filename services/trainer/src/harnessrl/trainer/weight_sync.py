"""Weight sync to every vLLM replica, verified by a logprob probe.

CPU path (run here): each replica reloads the step's HF safetensors (`VllmReplica.reload_from`, which
needs the project's vLLM plugin so CPU linears pick the new weights up), is labelled with the new
weight version, and then scores a fixed token sequence; its logprobs must equal the trainer's within
`tolerance`, or `WeightSyncError` is raised: an HTTP 200 from a reload proves nothing. In
collocated mode replicas are paused (`keep`) around the update, so no token is sampled from mixed
weights; the gateway's calls simply wait.

GPU path: `nccl_sync.NcclReplicaSync`, vLLM's native NCCL weight transfer behind the same
interface (written against vLLM's API, not run here: no GPU).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from harnessrl.shared.log import get_logger
from harnessrl.trainer.errors import WeightSyncError
from harnessrl.trainer.replica import VllmReplica

log = get_logger(__name__)
TrainerProbe = Callable[[Sequence[int]], Awaitable[list[float]]]


class WeightSyncer(Protocol):
    """What the service needs from a weight-sync back-end (disk reload or NCCL)."""

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> float:
        """Make every replica serve `version`; return the worst probe gap."""

    async def close(self) -> None:
        """Release clients and connections."""


class ReplicaSync:
    """Fans a checkpoint out to every replica and checks each one with the probe."""

    def __init__(
        self,
        replicas: Sequence[VllmReplica],
        probe_ids: Sequence[int],
        *,
        tolerance: float = 0.02,
        collocated: bool = False,
    ) -> None:
        self.replicas = list(replicas)
        self.probe_ids = list(probe_ids)
        self.tolerance = tolerance
        self.collocated = collocated

    async def close(self) -> None:
        """Close every replica client."""
        for replica in self.replicas:
            await replica.close()

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> float:
        """Reload `hf_dir` everywhere, label it `version`, verify; returns the worst probe gap."""
        if not self.replicas:
            return 0.0
        expected = await trainer_probe(self.probe_ids)
        gaps = await asyncio.gather(
            *(self._sync_one(replica, hf_dir, version, expected) for replica in self.replicas)
        )
        return max(gaps)

    async def _sync_one(
        self, replica: VllmReplica, hf_dir: Path, version: int, expected: list[float]
    ) -> float:
        if self.collocated:
            await replica.pause("keep")
        try:
            await replica.reload_from(hf_dir)
            await replica.set_weight_version(version)
        finally:
            if self.collocated:
                await replica.resume()
        return await verify_probe(replica, self.probe_ids, expected, self.tolerance, version)


async def verify_probe(
    replica: VllmReplica,
    probe_ids: Sequence[int],
    expected: Sequence[float],
    tolerance: float,
    version: int,
) -> float:
    """Score `probe_ids` on `replica`; raise `WeightSyncError` unless it matches `expected`."""
    probe = await replica.probe_logprobs(probe_ids)
    gap = max(abs(a - b) for a, b in zip(probe.prompt, expected, strict=True))
    if gap > tolerance:
        raise WeightSyncError(
            f"replica {replica.base_url} logprobs differ from the trainer's by {gap:.4f}"
            f" after loading version {version} (tolerance {tolerance})"
        )
    log.info("weights.synced", replica=replica.base_url, version=version, probe_gap=gap)
    return gap
