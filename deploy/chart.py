"""Render and lint the chart with Helm's own engine, offline (`helm-python-sdk`).

The SDK is Helm's Go code behind a C ABI: `Chart.render` is `helm template` (values
coalesced with the chart's defaults and checked against `values.schema.json`), `lint` is
`helm lint`. Its Go side logs to the process's stderr (file descriptor 2), around Python's
back; `native_stderr()` collects those lines so the checker can show the ones that matter.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "charge-worker"
DEPLOY = ROOT / "deploy"
RELEASE = "charge-worker"
NAMESPACE = "billing"

# Value sets the chart must render, each a list of values files merged in order. The chart
# has no defaults for the servers and the Secret's name on purpose, so "defaults" is the
# chart's values plus exactly those four.
VALUE_SETS: dict[str, list[Path]] = {
    "defaults": [DEPLOY / "values-required.yaml"],
    "all-on": [DEPLOY / "values-all-on.yaml"],
}

# Go's log lines that are expected and say nothing new: Helm follows the chart's symlinks
# (files/ -> config/) and says so on every load; lint notes `required` values it tolerates.
_EXPECTED_NOISE = ("found symbolic link in path", "missing required values")


@dataclass(frozen=True)
class Manifest:
    """One rendered object and the template it came from."""

    template: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.obj.get("metadata", {}).get("name", ""))

    @property
    def is_hook(self) -> bool:
        annotations = self.obj.get("metadata", {}).get("annotations") or {}
        return "helm.sh/hook" in annotations


class RenderError(Exception):
    """Helm refused to render (a `required`, a `fail`, or values the schema rejects)."""


@contextlib.contextmanager
def native_stderr(sink: list[str]) -> Iterator[None]:
    """Collect what native code writes to fd 2 meanwhile into `sink`, less known noise."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if line.strip() and not any(noise in line for noise in _EXPECTED_NOISE):
                    sink.append(line)


def load_values(files: list[Path]) -> dict[str, Any]:
    """The values files merged in order (later files win, maps merge deeply, like `-f`)."""
    merged: dict[str, Any] = {}
    for path in files:
        merge(merged, yaml.safe_load(path.read_text()) or {})
    return merged


def merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def render(
    values: dict[str, Any], *, source: Path = CHART, log: list[str] | None = None
) -> list[Manifest]:
    """Every object the chart renders for `values` (hooks included), in template order.

    `source` is the chart's directory, or a packaged chart (.tgz).
    """
    sink: list[str] = [] if log is None else log
    try:
        with native_stderr(sink), helm.Chart.load(source) as chart:
            rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as error:
        raise RenderError(str(error)) from error
    manifests: list[Manifest] = []
    for template, text in sorted(rendered.items()):
        if not template.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        manifests.extend(Manifest(template, obj) for obj in yaml.safe_load_all(text) if obj)
    return manifests


@dataclass(frozen=True)
class LintReport:
    """`helm lint --strict`: findings at warning level or above fail, info is shown."""

    problems: list[str]
    notes: list[str]


def lint(values: dict[str, Any], kube_version: str) -> LintReport:
    """Lint the chart with `values` as `helm lint --strict --kube-version` does."""
    noise: list[str] = []
    with native_stderr(noise):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{kube_version}")
    messages = report.get("messages") or []
    problems = [str(error) for error in report.get("errors") or []]
    problems += [
        f"{m['path']}: {m['error']}" for m in messages if int(m.get("severity", 0)) >= 2
    ]  # severity 2 is warning, 3 error, 1 info
    notes = [f"{m['path']}: {m['error']}" for m in messages if int(m.get("severity", 0)) < 2]
    return LintReport(problems, notes)


def check_package(values: dict[str, Any]) -> list[str]:
    """`helm package` stores the symlinked files' content: the archive renders the same."""
    with tempfile.TemporaryDirectory() as out:
        with native_stderr([]):
            archive = helm.package(CHART, destination=out)
        packaged = render(values, source=Path(archive))
    if packaged != render(values):
        return [f"the packaged chart {Path(archive).name} renders other objects than the chart"]
    return []


def coalesced(values: dict[str, Any]) -> dict[str, Any]:
    """The values a release would use: the chart's defaults with `values` over them."""
    with native_stderr([]), helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def chart_metadata() -> dict[str, Any]:
    """Chart.yaml as Helm reads it."""
    with native_stderr([]), helm.Chart.load(CHART) as chart:
        return chart.metadata


def chart_defaults() -> dict[str, Any]:
    """values.yaml as Helm reads it."""
    with native_stderr([]), helm.Chart.load(CHART) as chart:
        return chart.values


def helm_version() -> str:
    return helm.helm_sdk_version()
