"""charge_worker uses nats-py and prometheus-client through their public API only.

A private name has no promise behind it: a patch release can rename or remove it, and the
lock file is then the only thing between us and a broken worker (STYLE.md, 19). Read from
the source of every module under `src/charge_worker` (ast, so a lazy import inside a
function counts too), this test fails on:

- an `import` or `from … import` of a `nats` or `prometheus_client` module path with a
  segment that starts with `_` (dunders such as `__version__` are public);
- an import of prometheus_client's internal modules (`samples`, `utils`, `metrics_core`,
  `values`, `mmap_dict`), as a path or as `from prometheus_client import utils`;
- `from nats… import _name` or `from prometheus_client… import _name`;
- an attribute `_send_command` on anything, or the string `"_send_command"` (a `getattr`);
- an attribute `._x` read from a name that holds a nats client or JetStream context by
  this codebase's naming: `nc`, `js`, `nats`, `jetstream`, `_nc`, `_js` (so `nc._x`,
  `js._x`, `self._nc._x`, `self.js._x`), or from a metric or registry (`metrics.charges._x`,
  `registry._x`).

What it cannot see: a private attribute read through a variable named otherwise (an ast
does not know types). Those names are the ones this codebase gives its clients; a new name
for a client is a reason to extend `HANDLES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import charge_worker

ROOT = Path(charge_worker.__file__).parent
LIBRARIES = ("nats", "prometheus_client")
PROMETHEUS_INTERNALS = {"samples", "utils", "metrics_core", "values", "mmap_dict"}
HANDLES = {"nc", "js", "nats", "jetstream", "_nc", "_js"}
METRIC_HANDLES = {"metrics", "registry"}
KNOWN_PRIVATE = "_send_command"


@dataclass(frozen=True)
class Finding:
    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _library_path_findings(module: str) -> Iterator[str]:
    """What is private about importing this dotted path, if it is one of LIBRARIES'."""
    parts = module.split(".")
    if parts[0] not in LIBRARIES:
        return
    if any(_private(part) for part in parts):
        yield f"import of private module {module}"
    elif parts[0] == "prometheus_client" and len(parts) > 1 and parts[1] in PROMETHEUS_INTERNALS:
        yield f"import of prometheus_client internal module {module}"


def _handle(node: ast.expr) -> str | None:
    """The last name of the expression an attribute is read from: `nc` for `nc`, `_nc`
    for `self._nc`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _reads_a_metric(node: ast.expr) -> bool:
    """`registry`, `metrics.charges`, `self.metrics.charges.labels(…)`: an expression
    that passes through a metrics object or a registry."""
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            if node.attr in METRIC_HANDLES:
                return True
            node = node.value
        else:
            return isinstance(node, ast.Name) and node.id in METRIC_HANDLES


def _import_findings(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield from _library_path_findings(alias.name)
        return
    if not node.module or node.level or node.module.split(".")[0] not in LIBRARIES:
        return
    of_path = list(_library_path_findings(node.module))
    yield from of_path
    for alias in node.names:
        if _private(alias.name):
            yield f"import of {node.module}.{alias.name}"
        elif not of_path:  # `from prometheus_client import utils` names a module
            yield from _library_path_findings(f"{node.module}.{alias.name}")


def _attribute_finding(node: ast.Attribute) -> str | None:
    if not _private(node.attr):
        return None
    if node.attr == KNOWN_PRIVATE:
        return f"attribute {node.attr}"
    if _handle(node.value) in HANDLES:
        return f"attribute {node.attr} of a nats client"
    if _reads_a_metric(node.value):
        return f"attribute {node.attr} of a metric"
    return None


def findings(source: str) -> list[Finding]:
    """Every use of a private nats-py or prometheus-client name this test can see."""
    found: list[Finding] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [Finding(node.lineno, what) for what in _import_findings(node)]
        elif isinstance(node, ast.Attribute) and (what := _attribute_finding(node)):
            found.append(Finding(node.lineno, what))
        elif isinstance(node, ast.Constant) and node.value == KNOWN_PRIVATE:
            found.append(Finding(node.lineno, f"string {KNOWN_PRIVATE!r}"))
    return sorted(found, key=lambda f: (f.line, f.what))


def test_no_module_uses_a_private_name_of_nats_or_prometheus_client() -> None:
    offending: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        offending += [f"{where} {f}" for f in findings(path.read_text())]
    assert not offending, "private names of a dependency:\n" + "\n".join(offending)


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from prometheus_client.samples import Sample", "internal module"),
        ("from prometheus_client.utils import floatToGoString", "internal module"),
        ("import prometheus_client.metrics_core", "internal module"),
        ("from prometheus_client import values", "internal module"),
        ("from prometheus_client.mmap_dict import MmapedDict", "internal module"),
        ("from nats.aio._os import x", "private module"),
        ("import nats._private.thing", "private module"),
        ("from nats.aio.client import _CRLF_", "import of nats.aio.client._CRLF_"),
        ("from prometheus_client.registry import _EmptyCollector", "import of"),
        ("async def f(nc):\n    await nc._send_command(b'')", "attribute _send_command"),
        ("async def f(c):\n    await c._send_command(b'')", "attribute _send_command"),
        ("getattr(client, '_send_command')", "string '_send_command'"),
        ("def f(nc):\n    return nc._pending", "of a nats client"),
        ("def f(self):\n    return self._nc._status", "of a nats client"),
        ("def f(self):\n    return self.js._prefix", "of a nats client"),
        ("def f(m):\n    return m.metrics.charges.labels('x')._value", "of a metric"),
        ("def f(registry):\n    return registry._names_to_collectors", "of a metric"),
    ],
)
def test_a_private_name_is_found(source: str, what: str) -> None:
    assert any(what in f.what for f in findings(source)), findings(source)


@pytest.mark.parametrize(
    "source",
    [
        "from prometheus_client import Counter, Histogram, CollectorRegistry",
        "from prometheus_client.registry import Collector",
        "from prometheus_client.core import CounterMetricFamily",
        "from prometheus_client.parser import text_string_to_metric_families",
        "from prometheus_client.openmetrics.exposition import generate_latest",
        "from nats.js.api import PubAck\nimport nats.errors",
        "from nats import __version__",
        "def f(self):\n    return self._nc.is_connected",
        "def f(self):\n    return self._lock",
        "from other._private import thing",
        "'not the name _send_command in a sentence'",
    ],
)
def test_public_names_and_own_privates_pass(source: str) -> None:
    assert findings(source) == []
