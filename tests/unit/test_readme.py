"""The README's configuration table is the user's reference: it must name every setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from charge_worker.settings import Settings, env_name

README = (Path(__file__).parents[2] / "README.md").read_text()

ALL = [
    env_name(group, field)
    for info in Settings.model_fields.values()
    if isinstance(group := info.annotation, type)
    for field in group.model_fields
]


@pytest.mark.parametrize("variable", ALL)
def test_readme_documents_setting(variable: str) -> None:
    short = variable.removesuffix("_MAX").removesuffix("_MIN")
    assert f"`{variable}`" in README or f"`{short}_MIN` / `_MAX`" in README


def test_readme_quickstart_has_the_two_commands() -> None:
    assert "make demo" in README
    assert "make test" in README
