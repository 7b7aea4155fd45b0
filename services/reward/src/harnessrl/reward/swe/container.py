"""Grading Jobs run on this machine: the Job's pod as podman (or docker) containers.

The reward service's `container` sandbox: the same ConfigMap and Job a Kubernetes grading builds
(`swe.kube`), run without a cluster. The init container copies the image's repository into the
pod's `work` volume, then the grading container runs over it; each with the pod's hardening as
the engine's flags: its uid, a read-only root, every capability dropped, no new privileges, no
network at all, the container's memory and CPU limits and a process cap. Volumes are folders of a
temporary directory (the ConfigMap's files read-only), removed with it. The grading container's
output is the pod's log, as `read_namespaced_pod_log` returns it in a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PIDS_LIMIT = 1024
LOG_LIMIT_BYTES = 32 * 1024 * 1024


class ContainerGrader:
    """Runs a grading Job's pod with a local container engine (the `KubernetesGrader` interface)."""

    sandbox = "container"

    def __init__(self, engine: str = "podman", namespace: str = "local") -> None:
        self.engine = engine
        self.namespace = namespace

    async def run(self, name: str, objects: list[dict[str, Any]], timeout_s: float) -> str:
        """Run the Job's containers in order; the grading container's output (empty if a copy failed)."""
        return await asyncio.to_thread(self._run_blocking, name, objects, timeout_s)

    def _run_blocking(self, name: str, objects: list[dict[str, Any]], timeout_s: float) -> str:
        config, job = objects
        pod = job["spec"]["template"]["spec"]
        deadline = time.monotonic() + timeout_s
        with tempfile.TemporaryDirectory(prefix="hrl-pod-") as tmp:
            volumes = _volumes(pod, config, Path(tmp), _uid(pod))
            for init in pod.get("initContainers", []):
                if self._run_container(name, pod, init, volumes, deadline)[0] != 0:
                    return ""
            return self._run_container(name, pod, pod["containers"][0], volumes, deadline)[1]

    def _run_container(
        self,
        name: str,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        volumes: dict[str, Path],
        deadline: float,
    ) -> tuple[int, str]:
        label = f"{name}-{container['name']}"
        args = [self.engine, "run", "--rm", "--name", label, *run_flags(pod, container, volumes)]
        command = list(container["command"])
        args += ["--entrypoint", command[0], container["image"], *command[1:]]
        try:
            done = subprocess.run(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            subprocess.run([self.engine, "rm", "--force", label], capture_output=True, check=False)
            return 124, _text(exc.stdout or b"")
        return done.returncode, _text(done.stdout)


def _text(output: bytes) -> str:
    return output[-LOG_LIMIT_BYTES:].decode("utf-8", errors="replace")


def _uid(pod: Mapping[str, Any]) -> int:
    return int(pod.get("securityContext", {}).get("runAsUser", 65534))


def _volumes(pod: Mapping[str, Any], config: Mapping[str, Any], root: Path, uid: int) -> dict[str, Path]:
    """A folder per pod volume: the ConfigMap's files (read-only), empty folders the pod's user owns."""
    folders: dict[str, Path] = {}
    for volume in pod.get("volumes", []):
        folder = root / volume["name"]
        folder.mkdir()
        if "configMap" in volume:
            for file, text in config["data"].items():
                (folder / file).write_text(text)
                (folder / file).chmod(0o444)
            folder.chmod(0o555)
        else:
            folder.chmod(0o777)
            with contextlib.suppress(PermissionError):  # an unprivileged engine maps users itself
                os.chown(folder, uid, uid)
        folders[volume["name"]] = folder
    root.chmod(0o755)
    return folders


def run_flags(pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path]) -> list[str]:
    """The engine's flags for one container of the pod: hardening, limits, environment, mounts."""
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    flags = ["--network", "none", "--pids-limit", str(PIDS_LIMIT), "--security-opt", "no-new-privileges"]
    if "runAsUser" in context:
        flags += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"]
    if context.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    flags += [f"--cap-drop={cap}" for cap in context.get("capabilities", {}).get("drop", [])]
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        flags += ["--memory", _bytes(str(limits["memory"]))]
    if "cpu" in limits:
        cpu = str(limits["cpu"])
        flags += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
    for variable in container.get("env", []):
        flags += ["--env", f"{variable['name']}={variable['value']}"]
    return flags + _mounts(container.get("volumeMounts", []), volumes)


def _mounts(mounts: Sequence[Mapping[str, Any]], volumes: Mapping[str, Path]) -> list[str]:
    flags: list[str] = []
    for mount in mounts:
        read_only = ",ro" if mount.get("readOnly") else ""
        flags += [
            "--mount",
            f"type=bind,source={volumes[mount['name']]},destination={mount['mountPath']}{read_only}",
        ]
    return flags


def _bytes(quantity: str) -> str:
    """A Kubernetes memory quantity (`2Gi`, `512Mi`) as the engine's byte count."""
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return str(int(float(quantity[: -len(suffix)]) * factor))
    return quantity
