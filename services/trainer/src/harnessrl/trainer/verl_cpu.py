"""A verl platform plugin that runs verl's FSDP2 training engine on the CPU.

verl 0.9.1 knows CUDA, NPU and ROCm platforms only. verl imports every entry point of the group
`verl.plugins` when `verl` itself is imported (`verl/__init__.py`); this module is registered there,
so importing it registers a `cpu` platform (gloo collectives, `torch.device("cpu")` as the current
device, no-op memory statistics) in `verl.plugin.platform.PlatformRegistry`. Auto-detection probes
platforms in registration order, so on a machine with a GPU verl's own CUDA platform still wins.

verl registers its FSDP engines for `cuda` and `npu` only; `register_cpu_engine()` adds the same
`FSDPEngineWithLMHead` class for device `cpu` (it is called lazily, right before an engine is built,
because importing the engine module at `import verl` time would be slow and circular).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

CPU_PLATFORM = "cpu"


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _cpu_device_module() -> types.ModuleType:
    """`torch.cpu` plus the CUDA-style calls verl makes on its device module (no-ops on the CPU)."""
    module = types.ModuleType("harnessrl_verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, _zero)
    for name in ("empty_cache", "set_per_process_memory_fraction", "reset_peak_memory_stats"):
        setattr(module, name, _nothing)
    module.is_available = lambda: True  # type: ignore[attr-defined]
    module.synchronize = _nothing  # type: ignore[attr-defined]
    module.manual_seed = torch.manual_seed  # type: ignore[attr-defined]
    module.manual_seed_all = torch.manual_seed  # type: ignore[attr-defined]
    module.get_rng_state = torch.get_rng_state  # type: ignore[attr-defined]
    module.set_rng_state = torch.set_rng_state  # type: ignore[attr-defined]
    module.mem_get_info = lambda *_a: (0, 0)  # type: ignore[attr-defined]
    module.current_device = lambda: "cpu"  # type: ignore[attr-defined]
    module.device_count = lambda: 1  # type: ignore[attr-defined]
    module.get_device_name = lambda *_a: "CPU"  # type: ignore[attr-defined]
    return module


@PlatformRegistry.register(platform=CPU_PLATFORM)
class PlatformCPU(PlatformBase):  # type: ignore[misc]
    """verl's platform interface for plain CPUs: gloo collectives, nothing to profile or pin."""

    _module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        """Device type string verl uses for tensors and device meshes."""
        return "cpu"

    @property
    def vendor_name(self) -> str:
        """No accelerator vendor."""
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        """A `torch.cpu` look-alike with CUDA-style memory calls."""
        return self._module

    def is_available(self) -> bool:
        """The CPU is always there."""
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Chosen by auto-detection only when no CUDA device is visible."""
        return not torch.cuda.is_available()

    def current_device(self) -> Any:
        """`torch.device("cpu")`: verl passes this to `.to()` and `torch.device()`."""
        return torch.device("cpu")

    def device_count(self) -> int:
        """One logical device per process."""
        return 1

    def set_device(self, device_index: int) -> None:
        """Nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous."""

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The CPU allocator has no such settings."""

    def empty_cache(self) -> None:
        """No cache to empty."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        """No compute capability on a CPU."""
        return None, None

    def communication_backend_name(self) -> str:
        """Collectives run over gloo."""
        return "gloo"

    def visible_devices_envvar(self) -> str:
        """An env var nothing reads, so verl's device masking is a no-op."""
        return "HARNESSRL_VISIBLE_CPUS"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        """No profiler ranges on the CPU."""
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        """Ray schedules CPU workers by CPU."""
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        """No device-masking variables to keep Ray from setting."""
        return []

    def is_ipc_supported(self) -> bool:
        """No device IPC handles on the CPU."""
        return False

    def cudart(self) -> None:
        """No CUDA runtime."""
        return None


def register_cpu_engine() -> None:
    """Register verl's FSDP language-model engine for device `cpu` (idempotent)."""
    # Imported here: this module is loaded while `verl/__init__` runs, before the engines exist.
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines.setdefault("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        if CPU_PLATFORM not in registry.setdefault(backend, {}):
            EngineRegistry.register("language_model", backend, device=CPU_PLATFORM)(FSDPEngineWithLMHead)
