"""Imports point down: command families -> shared adapters -> the floor, and never round.

Read from the source (every `import` statement, those inside functions too), so a lazy
import cannot hide a dependency. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import charge_worker

ROOT = Path(charge_worker.__file__).parent
FLOOR = {
    "settings",
    "errors",
    "logs",
    "tracing",
    "event_loop",
    "migrate",
    "display",
    "breaker",
    "deadline",
    "json_text",
    "declines",
    "money",
}
SHARED = {
    "messages",
    "periods",
    "partitions",
    "privileges",
    "ratelimit",
    "database",
    "ledger",
    "events",
    "streams",
    "dlq",
    "http",
    "gateway",
    "scoring",
    "outcomes",
    "retries",
    "jobs",
}
FAMILIES = {"worker", "producer", "reconcile", "webhooks", "admin", "explain"}
TOP = {"cli", "sandbox", "__main__", "__init__"}


def room(module: str) -> str:
    """The first part of a dotted name below `charge_worker`."""
    return module.split(".", maxsplit=1)[0]


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(parts), path


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Every `charge_worker.x.y` this file imports, as `x.y`."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "charge_worker":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("charge_worker."):
                module = node.module.removeprefix("charge_worker.")
                found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("charge_worker.")
                for a in node.names
                if a.name.startswith("charge_worker.")
            }
    return found


def allowed(source: str, target: str) -> bool:
    here, there = room(source), room(target)
    if here in TOP:
        return True
    if there in TOP:
        return False
    if here in FLOOR:
        return there in FLOOR
    if here in SHARED:
        return there in FLOOR | SHARED
    return there in FLOOR | SHARED or there == here  # a family: itself, and below it


def test_every_module_has_a_layer() -> None:
    rooms = {room(name) for name, _ in modules()}
    assert rooms <= FLOOR | SHARED | FAMILIES | TOP, rooms - (FLOOR | SHARED | FAMILIES | TOP)


@pytest.mark.parametrize(("name", "path"), list(modules()), ids=str)
def test_imports_point_down(name: str, path: Path) -> None:
    wrong = sorted(target for target in imports(path) if not allowed(name, target))
    assert not wrong, f"charge_worker.{name} imports upwards or sideways: {wrong}"


def test_no_import_cycle_at_module_level() -> None:
    known = dict(modules())

    def resolve(target: str) -> str | None:
        """The module a target names: itself, or the package it is (its `__init__`)."""
        return next((m for m in (target, f"{target}.__init__") if m in known), None)

    def edges(name: str, path: Path) -> set[str]:
        targets = {m for t in imports(path, top_level_only=True) if (m := resolve(t))}
        # `from pkg import module` loads pkg first, as every import of a module inside pkg
        # does: a package's own `__init__` is no edge of its modules
        parents = {f"{name.rsplit('.', i)[0]}.__init__" for i in range(1, name.count(".") + 1)}
        return targets - parents - {name}

    graph = {name: edges(name, path) for name, path in known.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        for target in graph[name]:
            visit(target, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_rule_catches_a_family_importing_another() -> None:
    assert not allowed("webhooks.serve", "worker.run")
    assert not allowed("ledger", "worker.decisions")
    assert not allowed("settings", "ledger")
    assert allowed("worker.consumer", "worker.pipeline")
    assert allowed("sandbox.demo.report", "worker.decisions")
