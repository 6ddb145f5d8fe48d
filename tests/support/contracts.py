"""The machine-readable contracts in `docs/contracts/`, for tests that check what the
product writes against them."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).parents[2] / "docs" / "contracts" / "schemas"


@functools.cache
def schema(name: str) -> Any:
    """A JSON Schema of `docs/contracts/schemas/` by file name."""
    return json.loads((SCHEMAS / name).read_text())
