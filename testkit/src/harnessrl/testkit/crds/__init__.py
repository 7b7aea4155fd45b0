"""Published CRD schemas of the operators the chart can hand the trainer to, and a strict validator.

Each JSON file here is the `openAPIV3Schema` of one served version of an upstream CRD (descriptions
removed; `source` names the repository, tag, commit and path it came from): JobSet
(jobset.x-k8s.io/v1alpha2), Kubeflow's PyTorchJob (kubeflow.org/v1) and prometheus-operator's
ServiceMonitor (monitoring.coreos.com/v1). `validate` checks a
rendered resource against it the way an API server with `--validate=strict` would: the schema's
types, enums and required fields (jsonschema), and no field the schema does not declare (an API
server prunes or, strictly, refuses those; jsonschema alone lets them through).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]

_HERE = Path(__file__).resolve().parent
FILES = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_v1alpha2_jobset.json",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_v1_pytorchjob.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
}


@cache
def fixture(api_version: str, kind: str) -> dict[str, Any]:
    """The stored fixture (`source` and `schema`) of one kind; KeyError for a kind not stored."""
    data: dict[str, Any] = json.loads((_HERE / FILES[(api_version, kind)]).read_text())
    return data


def _unknown_fields(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Paths of object keys the schema does not declare (where it declares its keys)."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            err
            for i, item in enumerate(value)
            for err in _unknown_fields(item, schema["items"], f"{path}[{i}]")
        ]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    properties: dict[str, Any] = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    errors = []
    for key, item in value.items():
        if key in properties:
            errors += _unknown_fields(item, properties[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            errors += _unknown_fields(item, extra, f"{path}.{key}")
        elif properties and extra is not True:
            errors.append(f"{path}.{key}: unknown field")
    return errors


def validate(resource: dict[str, Any]) -> list[str]:
    """Every way `resource` breaks its kind's published schema (empty: it is valid)."""
    schema = fixture(resource["apiVersion"], resource["kind"])["schema"]
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(resource)
    ]
    return errors + _unknown_fields(resource, schema, "")
