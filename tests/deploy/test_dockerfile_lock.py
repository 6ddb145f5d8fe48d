"""The image is built from the lock: dependencies with `--require-hashes`, the project with
`--no-deps`, and `.dockerignore` lets the lock into the build context."""

from __future__ import annotations

import pytest

_WHY = "the deploy extra is not installed (make check-deploy installs it and runs these tests)"
pytest.importorskip("helm_python", reason=_WHY)
pytest.importorskip("yaml", reason=_WHY)

from deploy import dockerfile  # noqa: E402

LOCKED = """\
FROM python:3.11.14-slim-bookworm AS build
COPY requirements/ requirements/
RUN pip install --require-hashes --no-deps -r requirements/runtime.txt
COPY . /src
RUN pip install --no-deps /src
FROM python:3.11.14-slim-bookworm
"""


def _problems(text: str) -> str:
    return " ".join(dockerfile.check_structure(text))


def test_the_real_dockerfile_installs_from_the_lock() -> None:
    text = dockerfile.DOCKERFILE.read_text()
    assert "hashes" not in _problems(text)
    assert "--no-deps" not in _problems(text)
    assert "!requirements/" in dockerfile.DOCKERIGNORE.read_text().split()


@pytest.mark.parametrize(
    ("careless", "says"),
    [
        (LOCKED.replace("--require-hashes ", ""), "--require-hashes"),
        (LOCKED.replace("-r requirements/runtime.txt", "-r requirements.in"), "runtime.txt"),
        (LOCKED.replace("pip install --no-deps /src", "pip install /src"), "--no-deps"),
        (LOCKED.replace("RUN pip install --no-deps /src", "RUN pip install nats-py"), "--no-deps"),
    ],
)
def test_the_structure_check_notices_an_unlocked_install(careless: str, says: str) -> None:
    assert says in _problems(careless)
    assert says not in _problems(LOCKED)


def test_the_dockerignore_check_wants_the_lock_in_the_context() -> None:
    lines = "*\n!pyproject.toml\n!README.md\n!src/\n!migrations/\n"
    assert any("!requirements/" in p for p in dockerfile.check_dockerignore(lines))
    assert dockerfile.check_dockerignore(lines + "!requirements/\n") == []
