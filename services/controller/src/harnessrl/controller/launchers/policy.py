"""What a run spec may ask of the launcher: an allow-list, checked at submit and again at launch.

Whoever can submit a run chooses the harness's image, its launcher and a `job_template` merged into
every episode Job. The controller holds a cluster token and the key-signing secret, so a run may
not: run its harness inside the controller (`kind = "local"` on a controller in a cluster), pull an
image the operator did not allow (`allowed_images`), or reach past the episode pod's hardening
through the template. A template may set scheduling (node selector, tolerations, affinity, priority,
runtime class, spread, pull secrets, grace period), labels and annotations other than harnessrl's
own, and the harness container's image, pull policy and resources; every other field is refused
with its path, the dangerous ones (host namespaces, service accounts, secrets, volumes, privileges)
with the reason.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harnessrl.controller.launchers.base import LaunchError
from harnessrl.shared.contracts import LauncherSpec

TEMPLATE = "launcher.job_template"
# Labels the controller sets and the episode NetworkPolicy and watches select on.
_OWN_LABEL_PREFIXES = ("harnessrl.io/", "app.kubernetes.io/managed-by")

_HOST = "episode pods never share the host's network, process or IPC namespace"
_IDENTITY = "episode pods run without a service account or its token"
_SECRETS = "an episode's environment holds its own key only (set plain variables in `launcher.env`)"
_PRIVILEGE = "the pod's security context is the controller's hardened one (harnessrl.shared.podpolicy)"
_VOLUMES = "episode pods mount only their own emptyDir workspace and /tmp"
_REASONS = {
    "hostNetwork": _HOST,
    "hostPID": _HOST,
    "hostIPC": _HOST,
    "hostUsers": _HOST,
    "shareProcessNamespace": _HOST,
    "serviceAccountName": _IDENTITY,
    "serviceAccount": _IDENTITY,
    "automountServiceAccountToken": _IDENTITY,
    "envFrom": _SECRETS,
    "env": _SECRETS,
    "securityContext": _PRIVILEGE,
    "volumes": _VOLUMES,
    "volumeMounts": _VOLUMES,
    "volumeDevices": _VOLUMES,
    "initContainers": "the workspace init container is the controller's own",
    "nodeName": "episodes are scheduled, not pinned to a node (use nodeSelector)",
}


class LaunchPolicyError(LaunchError):
    """A run's launcher asks for something the controller does not allow; names the field."""


Check = Callable[[str, Any], None]
Schema = Mapping[str, "Check | Schema"]


def check_launcher(spec: LauncherSpec, *, in_cluster: bool, allowed_images: Sequence[str]) -> None:
    """Refuse a launcher this controller must not run (`LaunchPolicyError` names the field)."""
    if spec.kind == "local" and in_cluster:
        raise LaunchPolicyError(
            '`launcher.kind = "local"` is refused: this controller runs in a cluster, where a local '
            "harness would run inside the controller pod beside its cluster token and the key "
            'secret; use kind = "kubernetes"'
        )
    if spec.kind != "kubernetes":
        return
    check_image(spec.image, allowed_images, where="launcher.image")
    if spec.job_template is not None:
        check_job_template(spec.job_template, allowed_images)


def check_image(image: str, allowed: Sequence[str], *, where: str) -> None:
    """Refuse an image no pattern of `allowed` matches (an empty list allows any image)."""
    if allowed and not any(fnmatch.fnmatchcase(image, pattern) for pattern in allowed):
        raise LaunchPolicyError(
            f"`{where}` = {image!r} is not an allowed image (allowed_images: {', '.join(allowed)})"
        )


def check_job_template(template: Any, allowed_images: Sequence[str] = ()) -> None:
    """Refuse a `job_template` that sets anything outside the allow-list (see the module docstring)."""

    def image(path: str, value: Any) -> None:
        _string(path, value)
        check_image(value, allowed_images, where=path)

    harness: Schema = {"image": image, "imagePullPolicy": _string, "resources": _RESOURCES}
    pod: Schema = {
        "nodeSelector": _string_map,
        "tolerations": _anything,
        "affinity": _anything,
        "topologySpreadConstraints": _anything,
        "priorityClassName": _string,
        "runtimeClassName": _string,
        "imagePullSecrets": _anything,
        "terminationGracePeriodSeconds": _integer,
        "containers": _only_first(harness),
    }
    metadata: Schema = {"labels": _labels, "annotations": _string_map}
    schema: Schema = {"metadata": metadata, "spec": {"template": {"metadata": metadata, "spec": pod}}}
    _check(TEMPLATE, template, schema)


def _check(path: str, value: Any, schema: Check | Schema) -> None:
    if callable(schema):
        schema(path, value)
        return
    if not isinstance(value, dict):
        raise LaunchPolicyError(f"`{path}` must be a table of fields, not {type(value).__name__}")
    for key, item in value.items():
        where = f"{path}.{key}"
        if key not in schema:
            reason = _REASONS.get(key, f"a job_template may set only {', '.join(sorted(schema))} here")
            raise LaunchPolicyError(f"`{where}` is not allowed: {reason}")
        _check(where, item, schema[key])


def _only_first(schema: Schema) -> Check:
    """A list whose first item (the harness container, merged item by item) follows `schema`."""

    def check(path: str, value: Any) -> None:
        if not isinstance(value, list):
            raise LaunchPolicyError(f"`{path}` must be a list, not {type(value).__name__}")
        if len(value) > 1:
            raise LaunchPolicyError(f"`{path}[1]` is not allowed: an episode pod runs one container")
        for index, item in enumerate(value):
            _check(f"{path}[{index}]", item, schema)

    return check


def _labels(path: str, value: Any) -> None:
    _string_map(path, value)
    for key in value:
        if key.startswith(_OWN_LABEL_PREFIXES):
            raise LaunchPolicyError(
                f"`{path}.{key}` is not allowed: the controller's own labels select the episode's "
                "NetworkPolicy and watches"
            )


def _string(path: str, value: Any) -> None:
    if not isinstance(value, str):
        raise LaunchPolicyError(f"`{path}` must be a string, not {type(value).__name__}")


def _integer(path: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LaunchPolicyError(f"`{path}` must be a non-negative integer")


def _string_map(path: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise LaunchPolicyError(f"`{path}` must be a table of strings")


def _anything(path: str, value: Any) -> None:
    """Scheduling data: it places the pod, it grants nothing."""


def _quantities(path: str, value: Any) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str | int | float) and not isinstance(v, bool)
        for k, v in value.items()
    ):
        raise LaunchPolicyError(f'`{path}` must be a table of quantities (`cpu = "2"`)')


_QUANTITY: Check = _quantities
_RESOURCES: Schema = {"requests": _QUANTITY, "limits": _QUANTITY}
