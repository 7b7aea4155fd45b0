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
  with the version -> `/resume`. Every tensor of the model is sent (a layer that receives nothing
  keeps its old weights), as bf16 except the names in `keep_fp32`.
- An NCCL broadcast has no timeout: it runs on a thread under `asyncio.wait_for`; a round that
  times out raises `WeightSyncError` and leaves the group unusable (restart the trainer).
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
from harnessrl.trainer.weight_sync import TrainerProbe, verify_probe


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
        tolerance: float = 0.02,
        round_timeout_s: float = 600.0,
        keep_fp32: Sequence[str] = ("mlp.gate.weight",),
    ) -> None:
        self.engine = engine
        self.replicas = list(replicas)
        self.probe_ids = list(probe_ids)
        self.master_address = master_address
        self.master_port = master_port
        self.tolerance = tolerance
        self.round_timeout_s = round_timeout_s
        self.keep_fp32 = tuple(keep_fp32)
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

    async def sync(self, hf_dir: Path, version: int, trainer_probe: TrainerProbe) -> float:
        """Push the engine's current weights to every replica as `version`; verify by probe."""
        if not self.replicas:
            return 0.0
        if self._group is None:
            await self._connect()
        tensors = self._tensors()
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
                raise WeightSyncError(f"NCCL broadcast of version {version} timed out") from exc
            await asyncio.gather(*receivers)
            body = {"weight_version": str(version)}
            await asyncio.gather(*(_call(r, "POST", "/finish_weight_update", body) for r in self.replicas))
        finally:
            await asyncio.gather(*(replica.resume() for replica in self.replicas))
        expected = await trainer_probe(self.probe_ids)
        gaps = [
            await verify_probe(replica, self.probe_ids, expected, self.tolerance, version)
            for replica in self.replicas
        ]
        return max(gaps)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        params, _ = self.engine.worker.engine.get_per_tensor_param()
        out = []
        for name, tensor in params:
            dtype = torch.float32 if name.endswith(self.keep_fp32) else torch.bfloat16
            out.append((name, tensor.detach().to(dtype).contiguous()))
        return out

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
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
