"""`charge-worker demo` as a user runs it: the whole story, to the end, on a clean machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

DEMO_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_charges_every_key_once_and_dead_letters_the_bad_ones() -> None:
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("CHARGE_WORKER_") and key not in ("NATS_URL", "DATABASE_URL")
    }
    result = subprocess.run(
        [sys.executable, "-m", "charge_worker", "demo"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    output = result.stdout
    assert result.returncode == 0, f"{output}\n{result.stderr}"
    assert re.search(r"\b20 keys, each charged exactly once", output), output
    assert "charged 2 times" not in output
    assert re.search(r"#\d+ poison .*not UTF-8 JSON", output), output
    assert re.search(r"#\d+ poison .*amount_minor", output), output
    assert re.search(r"#\d+ conflict .*order 1003 ", output), output
    assert "worker-1 exited 0, worker-2 exited 0" in output
    assert "every expectation held" in output
