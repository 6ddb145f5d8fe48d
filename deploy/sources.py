"""One source of truth: what the chart embeds or mirrors must equal what the project holds.

- The alert rules: `helm/charge-worker/files/alerts.yml` is a symlink to
  `config/alerts.yml` (Helm follows it when it loads or packages the chart), and the
  rendered PrometheusRule must hold exactly its groups, less the excluded ones.
  With metrics.prometheusRule.scopeToNamespace every rule reads only its release's
  namespace (`scoped_expr`, mirrored by the chart's `charge-worker.scopedExpr`).
- The dashboard: likewise `files/grafana-dashboard.json`.
- The settings: values.schema.json's `config` names exactly the settings of
  `charge_worker.settings` that a ConfigMap may carry; the chart's appVersion is the
  package's version.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from deploy import catalog, chart
from deploy.chart import CHART, ROOT
from deploy.rendered import Rendered

EMBEDDED = {
    CHART / "files" / "alerts.yml": ROOT / "config" / "alerts.yml",
    CHART / "files" / "grafana-dashboard.json": ROOT / "config" / "grafana-dashboard.json",
}
# Chart defaults that differ from charge-worker's on purpose (the rest must be equal, so
# the templates' fallbacks and the application agree).
DELIBERATE = {
    "CHARGE_WORKER_STREAM_REPLICAS": "R3 streams on a JetStream cluster",
    "CHARGE_WORKER_LOG_FORMAT": "JSON logs in a pod, said outright",
    "CHARGE_WORKER_VERIFY_SUBSCRIPTION": "the chart runs produce: its subscriptions vouch",
}


def check_links(embedded: dict[Path, Path] | None = None) -> list[str]:
    """Each embedded file is a symlink resolving to the project's own file."""
    problems = []
    for link, source in (EMBEDDED if embedded is None else embedded).items():
        if not link.is_symlink():
            problems.append(f"{link} must be a symlink to {source}, not a copy")
        elif link.resolve() != source.resolve():
            problems.append(f"{link} points at {link.resolve()}, not {source}")
    return problems


# The series a rule may read that a release's pods (or Prometheus, of their targets)
# export: charge-worker's own (recorded ones too), the process and runtime collectors its
# registry carries, and `up`. Scoping adds namespace="<release namespace>" to each.
SCOPED_METRIC = r"(?:charge_worker|process|python)[_:][A-Za-z0-9_:]*|up"

# PromQL as tokens, in the order tried: a comment, a string, a grouping's label list, a
# name with its label matchers, matchers alone, a name alone, anything else (operators,
# numbers, brackets). Label names sit inside a grouping or matchers token, so they are
# never taken for series; a function is a name alone, and none is a SCOPED_METRIC.
_STRING = "\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`"
_GROUPING = r"(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
_MATCHERS = "\\{(?:[^}\"'`]|" + _STRING + ")*\\}"
_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
EXPR_TOKEN = "|".join(
    (
        r"#[^\n]*",
        _STRING,
        _GROUPING,
        _NAME + r"\s*" + _MATCHERS,
        _MATCHERS,
        _NAME,
        "[^#\"'`{A-Za-z_:]+",
    )
)


def scoped_expr(expr: str, namespace: str) -> str:
    """`expr` reading only `namespace`: namespace="<namespace>" first in the matchers of
    every selector of a SCOPED_METRIC name (`x` becomes `x{namespace="n"}`, `x{a="b"}`
    becomes `x{namespace="n",a="b"}`), whatever it sits in (sum, absent(), a subquery).

    The chart's `charge-worker.scopedExpr` does the same with the same expressions (Go's
    RE2 and Python's `re` agree on them): `check_alert_rules` compares the two.
    """
    tokens = re.findall(EXPR_TOKEN, expr, flags=re.ASCII)
    if "".join(tokens) != expr:
        raise ValueError(
            f"an expr the namespace scoping cannot read (an open quote or brace?): {expr}"
        )
    matcher = f'namespace="{namespace}"'
    return "".join(_scoped_token(token, matcher) for token in tokens)


def _scoped_token(token: str, matcher: str) -> str:
    if re.fullmatch(SCOPED_METRIC, token, flags=re.ASCII):  # x
        return f"{token}{{{matcher}}}"
    if re.fullmatch(rf"(?:{SCOPED_METRIC})\s*\{{\s*\}}", token, flags=re.ASCII):  # x{}
        return re.sub(r"\s*\{\s*\}$", "", token) + f"{{{matcher}}}"
    if re.match(rf"(?:{SCOPED_METRIC})\s*\{{", token, flags=re.ASCII):  # x{a="b"}
        return re.sub(r"^([A-Za-z0-9_:]+)\s*\{", rf"\1{{{matcher},", token, count=1)
    return token


def expected_rule_groups(values: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
    """config/alerts.yml as the chart must render it: less the excluded groups (and
    charge-worker.webhooks without the receiver), every runbook_url on runbookBaseUrl,
    additionalLabels under each alert's own labels, and with scopeToNamespace every expr
    scoped to the release's `namespace` and every rule labelled with it."""
    wanted = values["metrics"]["prometheusRule"]
    excluded = set(wanted["excludeGroups"])
    if not values["webhooks"]["enabled"]:
        excluded.add("charge-worker.webhooks")
    source = yaml.safe_load((ROOT / "config" / "alerts.yml").read_text())
    groups = [g for g in source["groups"] if g["name"] not in excluded]
    for rule in (rule for group in groups for rule in group["rules"]):
        annotations = rule.get("annotations", {})
        if "runbook_url" in annotations:
            anchor = annotations["runbook_url"].partition("#")[2]
            annotations["runbook_url"] = f"{wanted['runbookBaseUrl']}#{anchor}"
        if "alert" in rule and wanted.get("additionalLabels"):
            rule["labels"] = {**wanted["additionalLabels"], **rule.get("labels", {})}
        if wanted["scopeToNamespace"]:
            rule["expr"] = scoped_expr(str(rule["expr"]), namespace)
            rule["labels"] = {**rule.get("labels", {}), "namespace": namespace}
    return groups


def check_alert_rules(rendered: Rendered) -> list[str]:
    """The PrometheusRule holds config/alerts.yml's groups, less the excluded, with the
    runbook base and extra labels of the values (`expected_rule_groups`)."""
    wanted = rendered.values["metrics"]["prometheusRule"]
    rules = rendered.of_kind("PrometheusRule")
    if not wanted["enabled"]:
        return ["a PrometheusRule is rendered while disabled"] if rules else []
    if len(rules) != 1:
        return [f"{len(rules)} PrometheusRules rendered, expected 1"]
    expected = expected_rule_groups(rendered.values, chart.NAMESPACE)
    got = rules[0].obj["spec"]["groups"]
    if got == expected:
        return []
    names = [g["name"] for g in got]
    return [f"PrometheusRule groups {names} differ from config/alerts.yml less excluded groups"]


def check_dashboard(rendered: Rendered) -> list[str]:
    """The dashboard ConfigMap carries config/grafana-dashboard.json and the sidecar label."""
    wanted = rendered.values["metrics"]["grafanaDashboard"]
    maps = [
        m for m in rendered.of_kind("ConfigMap") if "charge-worker.json" in m.obj.get("data", {})
    ]
    if not wanted["enabled"]:
        return ["a dashboard ConfigMap is rendered while disabled"] if maps else []
    if len(maps) != 1:
        return [f"{len(maps)} dashboard ConfigMaps rendered, expected 1"]
    problems = []
    labels = maps[0].obj["metadata"].get("labels", {})
    if labels.get("grafana_dashboard") != "1":
        problems.append(f'ConfigMap/{maps[0].name} lacks the label grafana_dashboard: "1"')
    source = json.loads((ROOT / "config" / "grafana-dashboard.json").read_text())
    if json.loads(maps[0].obj["data"]["charge-worker.json"]) != source:
        problems.append(f"ConfigMap/{maps[0].name} differs from config/grafana-dashboard.json")
    return problems


def check_settings_schema() -> list[str]:
    """values.schema.json's `config` names every configurable setting, and nothing else;
    its `extraEnv` takes every secret setting by reference only."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]
    named = set(config["properties"])
    allowed = catalog.configurable()
    problems = [
        f"values.schema.json config lacks {name} (a setting of charge_worker.settings)"
        for name in sorted(allowed - named)
    ]
    problems += [
        f"values.schema.json config allows {name}, which "
        + ("is a secret" if name in catalog.secrets() else "is no configurable setting")
        for name in sorted(named - allowed)
    ]
    if config.get("additionalProperties") is not False:
        problems.append("values.schema.json config must refuse unknown names")
    env_item = schema["properties"]["extraEnv"]["items"]
    by_reference = set(env_item["if"]["properties"]["name"]["enum"])
    if by_reference != catalog.secrets() or env_item["then"] != {"properties": {"value": False}}:
        problems.append(
            f"values.schema.json extraEnv must refuse a value for exactly the secrets "
            f"{sorted(catalog.secrets())}, it names {sorted(by_reference)}"
        )
    return problems


def check_chart_defaults(defaults: dict[str, Any]) -> list[str]:
    """values.yaml references secrets by name only, and mirrors charge-worker's defaults."""
    problems = []
    for path in (
        "secrets.existingSecret",
        "natsCredentials.existingSecret",
        "migrate.existingSecret",
        "webhooks.secrets.existingSecret",
    ):
        node: Any = defaults
        for part in path.split("."):
            node = node[part]
        if node != "":
            problems.append(f"values.yaml: {path} must have no default (it is {node!r})")
    for name, value in (defaults.get("config") or {}).items():
        if value in (None, "") or name in DELIBERATE:
            continue
        if name in catalog.settings() and _text(value) != _text(catalog.default(name)):
            problems.append(
                f"values.yaml: config.{name} is {value!r} but charge-worker's default is "
                f"{catalog.default(name)!r}; make them equal or list it in DELIBERATE"
            )
    return problems


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def check_versions(metadata: dict[str, Any]) -> list[str]:
    """Chart.yaml's appVersion is the version pyproject.toml builds."""
    project = tomllib.loads(Path(ROOT / "pyproject.toml").read_text())["project"]["version"]
    if metadata.get("appVersion") != project:
        return [
            f"Chart.yaml appVersion {metadata.get('appVersion')} is not the package's {project}"
        ]
    return []


def values_keys(text: str) -> list[tuple[str, bool, bool]]:
    """values.yaml's keys in order: (dotted path, is a leaf, has a comment right above).

    A comment counts when it sits on the line(s) just above the key, at the key's indent.
    """
    keys: list[tuple[str, bool, bool]] = []
    stack: list[tuple[int, str]] = []
    commented = False
    lines = text.splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped:
            commented = False
            continue
        if stripped.startswith("#"):
            commented = True
            continue
        key = re.match(r"([A-Za-z0-9_]+):(.*)$", stripped)
        if key is None:  # a list item or a continued scalar
            commented = False
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), key.group(1)])
        following = next((x for x in lines[number + 1 :] if x.strip()), "")
        deeper = len(following) - len(following.lstrip()) > indent
        leaf = bool(key.group(2).strip()) or not deeper or following.strip().startswith("-")
        keys.append((path, leaf, commented))
        if not leaf:
            stack.append((indent, key.group(1)))
        commented = False
    return keys


def check_values_documented() -> list[str]:
    """Every setting in values.yaml has its own comment line(s) right above it."""
    text = (CHART / "values.yaml").read_text()
    return [
        f"values.yaml: {path} has no comment above it"
        for path, leaf, commented in values_keys(text)
        if leaf and not commented
    ]


def check_chart_readme() -> list[str]:
    """The chart README's values table covers every key of values.yaml (itself or a parent)."""
    readme = (CHART / "README.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE))
    problems = []
    for path, leaf, _ in values_keys((CHART / "values.yaml").read_text()):
        parts = path.split(".")
        if leaf and not any(".".join(parts[:n]) in rows for n in range(len(parts), 0, -1)):
            problems.append(f"helm/charge-worker/README.md: the values table lacks {path}")
    return problems
