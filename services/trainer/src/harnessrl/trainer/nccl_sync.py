"""GPU weight sync: vLLM's native NCCL weight transfer, fanned out to every replica.

Written against vLLM 0.31's dev-mode routes and `vllm.distributed.weight_transfer.nccl_common`
(see the README); it needs GPUs and vLLM in the trainer image and has not been run here.

- Rendezvous: the trainer is NCCL rank 0 and the only sender; it hosts the TCP store on
  `master_address` (routable from the replicas). Replica i's workers take ranks from its
  `rank_offset` = 1 + the world sizes of the replicas before it (`/get_world_size`), so several
  replicas share one group (vLLM's own client hard-codes offset 1 and sends no version).
  `/init_weight_transfer_engine` blocks until the trainer joins, so every init is in flight while
  the trainer opens its endpoint.
- A round: `/pause` (keep) -> `/start_weight_update` -> `/update_weights` (names, dtypes, shapes,
  in iteration order) concurrently with the trainer's broadcasts -> `/finish_weight_update`
  without a version -> `/resume`. Every tensor of the model is sent (a layer that receives nothing
  keeps its old weights), as bf16 except the names in `keep_fp32`.
- Then, as in `weight_sync`: every replica is probed (it must be resumed to schedule the probe)
  and labelled with the version (`/update_weight_version`) only if it passed; a replica that
  failed is withdrawn (`on_failed`) and the sync goes on with the others.
- An NCCL broadcast has no timeout: it runs on a thread under `asyncio.wait_for`. A round that
  fails or times out leaves every replica with weights of unknown state, so all are withdrawn and
  `WeightSyncError` is raised; the group is unusable afterwards (restart the trainer).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import torch

from harnessrl.trainer.engine import PolicyEngine
from harnessrl.trainer.errors import WeightSyncError
from harnessrl.trainer.replica import VllmReplica
from harnessrl.trainer.weight_sync import (
    REPLICA_FAILURES,
    FailureCallback,
    ProbeHistory,
    ProbeReference,
    ReplicaOutcome,
    RestoreCallback,
    RingMembership,
    SyncResult,
    TrainerProbe,
    check_and_label,
    failed_outcome,
)

Tensors = list[tuple[str, torch.Tensor]]
# What a failed round raises: our own timeout/refusal, or a replica's transport error.
_ROUND_FAILURES: tuple[type[Exception], ...] = (WeightSyncError, *REPLICA_FAILURES)


class NcclReplicaSync:
    """Same interface as `weight_sync.ReplicaSync`, moving weights over NCCL instead of disk."""

    def __init__(
        self,
        engine: PolicyEngine,
        replicas: Sequence[VllmReplica],
        probe_ids: Sequence[int],
        *,
        master_address: str,
        master_port: int,
        tolerance: float = 1e-3,
        round_timeout_s: float = 600.0,
        keep_fp32: Sequence[str] = ("mlp.gate.weight",),
        on_failed: FailureCallback | None = None,
        on_restored: RestoreCallback | None = None,
    ) -> None:
        self.engine = engine
        self.replicas = list(replicas)
        self.probe_ids = list(probe_ids)
        self.master_address = master_address
        self.master_port = master_port
        self.tolerance = tolerance
        self.round_timeout_s = round_timeout_s
        self.keep_fp32 = tuple(keep_fp32)
        self.history = ProbeHistory()
        self.membership = RingMembership(on_failed, on_restored)
        self._group: Any = None

    async def close(self) -> None:
        """Close the replica clients (the NCCL group dies with the process)."""
        for replica in self.replicas:
            await replica.close()

    async def _connect(self) -> None:
        sizes = [await _world_size(replica) for replica in self.replicas]
        world_size = 1 + sum(sizes)
        inits = []
        offset = 1
        for replica, size in zip(self.replicas, sizes, strict=True):
            info = {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "packed": False,
            }
            inits.append(_call(replica, "POST", "/init_weight_transfer_engine", {"init_info": info}))
            offset += size
        pending = [asyncio.ensure_future(init) for init in inits]
        self._group = await asyncio.to_thread(self._open_endpoint, world_size)
        await asyncio.gather(*pending)

    def _open_endpoint(self, world_size: int) -> Any:
        from vllm.distributed.weight_transfer.nccl_common import (
            trainer_init,
        )

        rendezvous = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": world_size,
        }
        return trainer_init(rendezvous, rank=0)

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> SyncResult:
        """Push the engine's current weights to every replica; label `version` where the probe passed."""
        if not self.replicas:
            return SyncResult()
        if self._group is None:
            await self._connect()
        try:
            await self._round(self._tensors())
        except _ROUND_FAILURES as exc:
            await self.membership.record([failed_outcome(r, exc) for r in self.replicas], version)
            raise WeightSyncError(f"NCCL round of version {version} failed: {exc}") from exc
        reference = self.history.reference(version, await trainer_probe(self.probe_ids))
        outcomes = await asyncio.gather(*(self._verify(replica, reference) for replica in self.replicas))
        return await self.membership.settle(outcomes, version)

    async def _round(self, tensors: Tensors) -> None:
        """One update round on every replica, paused (`keep`) throughout and always resumed."""
        update_info = {
            "names": [name for name, _ in tensors],
            "dtype_names": [str(tensor.dtype).split(".")[-1] for _, tensor in tensors],
            "shapes": [list(tensor.shape) for _, tensor in tensors],
        }
        await asyncio.gather(*(replica.pause("keep") for replica in self.replicas))
        try:
            await asyncio.gather(*(_call(r, "POST", "/start_weight_update") for r in self.replicas))
            receivers = [
                asyncio.ensure_future(_call(r, "POST", "/update_weights", {"update_info": update_info}))
                for r in self.replicas
            ]
            try:
                await asyncio.wait_for(asyncio.to_thread(self._broadcast, tensors), self.round_timeout_s)
            except TimeoutError as exc:
                raise WeightSyncError(f"NCCL broadcast timed out after {self.round_timeout_s} s") from exc
            await asyncio.gather(*receivers)
            await asyncio.gather(*(_call(r, "POST", "/finish_weight_update", {}) for r in self.replicas))
        finally:
            await asyncio.gather(*(replica.resume() for replica in self.replicas))

    async def _verify(self, replica: VllmReplica, reference: ProbeReference) -> ReplicaOutcome:
        try:
            return await check_and_label(replica, self.probe_ids, reference, self.tolerance)
        except REPLICA_FAILURES as exc:
            return failed_outcome(replica, exc)

    def _tensors(self) -> Tensors:
        """The full weights in wire dtypes (bf16, fp32 for `keep_fp32`); a collective on every rank."""

        def wire(name: str, tensor: torch.Tensor) -> torch.Tensor:
            dtype = torch.float32 if name.endswith(self.keep_fp32) else torch.bfloat16
            return tensor.detach().to(dtype).contiguous()

        return self.engine.full_params(wire)

    def _broadcast(self, tensors: Tensors) -> None:
        stream = torch.cuda.current_stream()
        for _name, tensor in tensors:
            self._group.broadcast(tensor, src=0, stream=stream)
        torch.cuda.synchronize()


async def _call(replica: VllmReplica, method: str, path: str, body: Any = None) -> Any:
    """An admin route `VllmReplica` has no method for (the weight-transfer routes)."""
    timeout = aiohttp.ClientTimeout(total=None)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, f"{replica.base_url}{path}", json=body) as response,
    ):
        text = await response.text()
        if response.status != 200:
            raise WeightSyncError(f"{method} {path} on {replica.base_url}: {response.status} {text}")
        return json.loads(text) if text else None


async def _world_size(replica: VllmReplica) -> int:
    answer = await _call(replica, "GET", "/get_world_size")
    return int(answer["world_size"])
