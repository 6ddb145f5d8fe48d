"""Validate rendered objects against schemas: Kubernetes' own, and the vendored CRD ones.

Core kinds go through `kubernetes-validate` in strict mode (unknown fields are errors), for
the oldest Kubernetes the chart supports and the newest the package knows. Custom resources
(`ServiceMonitor`, `PrometheusRule`, `ScaledObject`) are checked against the JSON schemas in
`deploy/schemas/` (see its README). A kind with neither is a failure, not a skip.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import kubernetes_validate.utils  # type: ignore[import-untyped]

from deploy.chart import CHART, DEPLOY, Manifest

SCHEMAS = DEPLOY / "schemas"
# Custom resources: apiVersion -> the folder of their schemas (named <kind>_<version>.json).
CUSTOM_GROUPS = ("monitoring.coreos.com", "keda.sh")


def kube_versions() -> list[str]:
    """The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest known."""
    newest = str(kubernetes_validate.utils.latest_version())
    return [oldest_supported(), newest]


def oldest_supported() -> str:
    text = (CHART / "Chart.yaml").read_text()
    for line in text.splitlines():
        if line.startswith("kubeVersion:"):
            return line.split(">=", 1)[1].strip().strip("\"'").removesuffix("-0")
    raise ValueError("Chart.yaml declares no kubeVersion")


def custom_schema_path(obj: dict[str, Any]) -> Path | None:
    """Where the vendored schema of a custom resource lives, or None for a core kind."""
    group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    if group not in CUSTOM_GROUPS:
        return None
    return SCHEMAS / group / f"{str(obj.get('kind', '')).lower()}_{version}.json"


@cache
def _validator(path: Path) -> jsonschema.protocols.Validator:
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def validate(manifest: Manifest, versions: list[str]) -> list[str]:
    """Every schema violation of one rendered object, as lines naming it and the field."""
    obj = manifest.obj
    where = f"{manifest.kind}/{manifest.name}"
    custom = custom_schema_path(obj)
    if custom is not None:
        if not custom.is_file():
            return [f"{where}: no vendored schema {custom.relative_to(DEPLOY.parent)}"]
        return [
            f"{where}: {_path(error.absolute_path)}: {error.message}"
            for error in sorted(_validator(custom).iter_errors(obj), key=str)
        ]
    problems = []
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{where} (Kubernetes {version}): {_path(error.path)}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: Kubernetes {version} has no {obj.get('apiVersion')}")
    return problems


def _path(parts: Any) -> str:
    return ".".join(str(part) for part in parts) or "(top)"


def check_values_schema() -> list[str]:
    """values.schema.json must itself be a valid JSON Schema."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        return [f"values.schema.json is not a valid JSON Schema: {error.message}"]
    return []
