"""A Kubernetes pod spec run as podman containers, as faithfully as one machine allows.

What carries over: the container's image, command and args (with `$(VAR)` references expanded the
way the kubelet does), env (plain values, `secretKeyRef`, `configMapKeyRef`, `fieldRef` to the pod's
name and namespace), volumes (emptyDir as a fresh world-writable folder, `medium: Memory` as a
sized tmpfs; configMap and secret as read-only files; persistentVolumeClaims as folders on the
host, one per claim, owned by the pod's `fsGroup`), working directory, the security context (user
and group, read-only root with no extra
tmpfs, capabilities dropped, no privilege escalation, the runtime's default seccomp profile) and
resource limits (memory, CPUs). Readiness is the container's own probe (httpGet, tcpSocket or exec)
checked from this machine against the container's address. What doesn't: Services (network aliases
stand in, see `cluster.py`), NetworkPolicies (separate podman networks stand in), the API server.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.testkit.images import PODMAN_FLAGS

SHM = "/dev/shm"  # noqa: S108 - the container's shared memory mount, not a temporary file
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class PodError(RuntimeError):
    """A pod spec uses something this runner cannot carry over, or a container failed."""


@dataclass
class Objects:
    """The rendered objects a pod may reference, by name."""

    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, obj: Mapping[str, Any]) -> None:
        """Keep a Secret's or ConfigMap's data (decoded); other kinds are ignored."""
        name = obj["metadata"]["name"]
        if obj["kind"] == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            data.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
            self.secrets[name] = data
        elif obj["kind"] == "ConfigMap":
            self.configmaps[name] = {k: str(v) for k, v in (obj.get("data") or {}).items()}


@dataclass(frozen=True)
class PodPlace:
    """Where one pod runs: its name and namespace, networks with aliases, its volumes' host folder."""

    name: str
    namespace: str
    networks: Mapping[str, Sequence[str]]
    state: Path
    # Claim name -> host folder (StatefulSet claims are named <template>-<pod>).
    claims: Mapping[str, Path] = field(default_factory=dict)
    # Environment overrides (the stand-in API server's address, for example).
    env: Mapping[str, str] = field(default_factory=dict)


def expand(text: str, env: Mapping[str, str]) -> str:
    """`$(VAR)` replaced by an earlier variable's value; unknown references stay as they are."""
    return _REF.sub(lambda m: env.get(m[1], m[0]), text)


def container_env(container: Mapping[str, Any], objects: Objects, place: PodPlace) -> dict[str, str]:
    """The container's environment, resolved in order like the kubelet does."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        env[name] = _env_from(name, source, objects, place)
    env.update(place.env)
    return env


def _env_from(name: str, source: Mapping[str, Any], objects: Objects, place: PodPlace) -> str:
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return _lookup(objects.secrets, "Secret", ref["name"], ref["key"], name)
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return _lookup(objects.configmaps, "ConfigMap", ref["name"], ref["key"], name)
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        fields = {"metadata.name": place.name, "metadata.namespace": place.namespace}
        if path in fields:
            return fields[path]
    raise PodError(f"env {name}: unsupported source {dict(source)}")


def _lookup(store: Mapping[str, Mapping[str, str]], kind: str, obj: str, key: str, var: str) -> str:
    if obj not in store or key not in store[obj]:
        raise PodError(f"env {var}: {kind} {obj} has no key {key}")
    return store[obj][key]


def volume_flags(
    pod: Mapping[str, Any], container: Mapping[str, Any], objects: Objects, place: PodPlace
) -> list[str]:
    """`--mount`/`--tmpfs` flags for the container's volume mounts."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    flags: list[str] = []
    for mount in container.get("volumeMounts") or []:
        name, target = mount["name"], mount["mountPath"]
        read_only = bool(mount.get("readOnly"))
        if name not in volumes and name not in place.claims:
            raise PodError(f"volume mount {name} has no volume")
        volume = volumes.get(name, {})
        if (volume.get("emptyDir") or {}).get("medium") == "Memory":
            flags += ["--tmpfs", f"{target}:rw,mode=1777{_size(volume['emptyDir'])}"]
            continue
        if "emptyDir" in volume:  # a fresh folder, world-writable like the kubelet's
            folder = place.state / "emptydir" / name
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o1777)
            flags += ["--mount", f"type=bind,source={folder},destination={target}"]
            continue
        source = _volume_source(name, volume, objects, place)
        read_only = read_only or "configMap" in volume or "secret" in volume  # always, in Kubernetes
        flags += ["--mount", f"type=bind,source={source},destination={target}{',ro' if read_only else ''}"]
    return flags


def _size(empty_dir: Mapping[str, Any]) -> str:
    limit = str(empty_dir.get("sizeLimit") or "")
    return f",size={limit.removesuffix('i').lower()}" if limit else ""


def _volume_source(name: str, volume: Mapping[str, Any], objects: Objects, place: PodPlace) -> Path:
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        if claim not in place.claims:
            raise PodError(f"volume {name}: no folder for claim {claim}")
        return place.claims[claim]
    if name in place.claims:  # a StatefulSet's volumeClaimTemplate
        return place.claims[name]
    for kind, store in (("configMap", objects.configmaps), ("secret", objects.secrets)):
        if kind in volume:
            ref = volume[kind].get("name") or volume[kind].get("secretName")
            if ref not in store:
                raise PodError(f"volume {name}: {kind} {ref} was not rendered")
            return _files(place.state / "volumes" / name, store[ref], volume[kind].get("items"))
    raise PodError(f"volume {name}: unsupported kind {sorted(volume)}")


def _files(folder: Path, data: Mapping[str, str], items: Sequence[Mapping[str, str]] | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
    for key, path in chosen.items():
        (folder / path).write_text(data[key])
        (folder / path).chmod(0o444)
    return folder


def security_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """User, read-only root, capabilities, privilege escalation and seccomp, container over pod."""
    pod_ctx = pod.get("securityContext") or {}
    ctx = {**pod_ctx, **(container.get("securityContext") or {})}
    flags: list[str] = []
    if "runAsUser" in ctx:
        flags += ["--user", f"{ctx['runAsUser']}:{ctx.get('runAsGroup', ctx['runAsUser'])}"]
    if "fsGroup" in pod_ctx:
        flags += ["--group-add", str(pod_ctx["fsGroup"])]
    if ctx.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]
    for cap in (ctx.get("capabilities") or {}).get("drop") or []:
        flags += ["--cap-drop", str(cap)]
    if ctx.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    if ctx.get("privileged"):
        raise PodError(f"container {container['name']} asks to be privileged")
    seccomp = (ctx.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp != "RuntimeDefault":
        raise PodError(f"container {container['name']}: seccomp {seccomp} not carried over")
    return flags


def resource_flags(container: Mapping[str, Any]) -> list[str]:
    """Memory and CPU limits."""
    limits = (container.get("resources") or {}).get("limits") or {}
    flags: list[str] = []
    if "memory" in limits:
        flags += ["--memory", _bytes(str(limits["memory"]))]
    if "cpu" in limits:
        cpu = str(limits["cpu"])
        flags += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
    return flags


def _bytes(quantity: str) -> str:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return str(int(float(quantity[: -len(suffix)]) * factor))
    return quantity


def run_args(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    objects: Objects,
    place: PodPlace,
    *,
    image: str,
    detach: bool = True,
) -> list[str]:
    """The `podman run` command line of one container of a pod."""
    env = container_env(container, objects, place)
    networks = list(place.networks.items())
    args = ["podman", "run", *PODMAN_FLAGS, "--name", f"{place.name}-{container['name']}"]
    args += ["-d"] if detach else []
    if detach and pod.get("restartPolicy", "Always") == "Always":
        args += ["--restart", "always"]  # the kubelet restarts a pod's exited container
    args += ["--label", f"io.harnessrl.pod={place.name}", "--hostname", place.name]
    for network, aliases in networks:
        spec = ",".join([f"alias={a}" for a in aliases])
        args += ["--network", f"{network}:{spec}" if spec else network]
    if not networks:
        args += ["--network", "none"]
    args += security_flags(pod, container) + resource_flags(container)
    if shm := _shm(pod, container):
        args += ["--shm-size", shm]
    args += volume_flags(pod, _without_shm(container), objects, place)
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    if "workingDir" in container:
        args += ["--workdir", container["workingDir"]]
    command = [expand(str(c), env) for c in container.get("command") or []]
    rest = [expand(str(a), env) for a in container.get("args") or []]
    if command:
        args += ["--entrypoint", json.dumps(command[:1])]
        rest = command[1:] + rest
    return [*args, image, *rest]


def _shm(pod: Mapping[str, Any], container: Mapping[str, Any]) -> str:
    """A memory emptyDir at /dev/shm becomes the container's shm size (not a tmpfs over it)."""
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        if mount["mountPath"] == SHM:
            empty = volumes.get(mount["name"], {}).get("emptyDir") or {}
            return str(empty.get("sizeLimit", "64Mi")).removesuffix("i").lower()
    return ""


def _without_shm(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container without its /dev/shm mount (carried by `--shm-size` instead)."""
    mounts = [m for m in container.get("volumeMounts") or [] if m["mountPath"] != SHM]
    return {**container, "volumeMounts": mounts}


def address(container_name: str, network: str) -> str:
    """The container's IP on a network."""
    done = subprocess.run(
        ["podman", "inspect", "--format", f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}',
         container_name],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip()


def probe_ok(container: Mapping[str, Any], probe: Mapping[str, Any], name: str, ip: str) -> bool:
    """One probe attempt from this machine against the container's address (or `podman exec`)."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    timeout = float(probe.get("timeoutSeconds", 1)) + 2
    if "httpGet" in probe:
        get = probe["httpGet"]
        port = ports.get(get["port"], get["port"])
        try:
            url = f"http://{ip}:{port}{get.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as answer:
                return 200 <= int(answer.status) < 400
        except (urllib.error.URLError, OSError):
            return False
    if "tcpSocket" in probe:
        port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
        try:
            with socket.create_connection((ip, int(port)), timeout=timeout):
                return True
        except OSError:
            return False
    if "exec" in probe:
        done = subprocess.run(
            ["podman", "exec", name, *probe["exec"]["command"]], capture_output=True, check=False
        )
        return done.returncode == 0
    raise PodError(f"probe of {name}: unsupported kind {sorted(probe)}")
