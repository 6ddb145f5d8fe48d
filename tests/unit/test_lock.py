"""The lock files agree with `pyproject.toml`, so a build from them is the build tested.

`uv.lock` holds every requirement of the project and of each extra, resolved for every
Python from 3.11 on and every platform, each file with its sha256; it also records the
project's own requirements as it read them from `pyproject.toml` (`requires-dist`,
`provides-extras`). `requirements/runtime.txt` (what the image installs, with
`--require-hashes`) is exported from it, and `requirements/build.txt` pins the build backend.
`make lock` writes all three; these tests read them and `pyproject.toml`, with no network,
and fail when someone changed one without running it.
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
RUNTIME = ROOT / "requirements" / "runtime.txt"
IMAGE_EXTRAS = ("otel",)  # `make lock` exports them with the runtime (traces in the image)
BUILD = ROOT / "requirements" / "build.txt"
PROJECT = "charge-worker"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")

# Where markers are compared: two requirements agree when their markers say the same in
# each of these (every Python and platform the project can meet, with and without extras).
EXTRAS = ("", *sorted(PYPROJECT["project"]["optional-dependencies"]))
ENVIRONMENTS = [
    {
        "python_version": ".".join(version.split(".")[:2]),
        "python_full_version": version,
        "sys_platform": platform,
        "extra": extra,
    }
    for version in ("3.11.0", "3.12.4", "3.13.0", "3.14.1", "3.15.0")
    for platform in ("linux", "darwin", "win32")
    for extra in EXTRAS
]

Key = tuple[str, str, tuple[bool, ...]]


def _key(name: str, specifier: str, applies: list[bool]) -> Key:
    ordered = ",".join(sorted(part.strip() for part in specifier.split(",") if part.strip()))
    return canonicalize_name(name), ordered, tuple(applies)


def pyproject_requirements() -> Counter[Key]:
    """Each requirement of pyproject.toml, an extra's only where that extra is asked for."""
    project = PYPROJECT["project"]
    sources: list[tuple[str, str]] = [("", r) for r in project["dependencies"]]
    for extra, requirements in project["optional-dependencies"].items():
        sources += [(extra, r) for r in requirements]
    keys: Counter[Key] = Counter()
    for extra, text in sources:
        requirement = Requirement(text)
        applies = [
            (not extra or env["extra"] == extra)
            and (requirement.marker is None or requirement.marker.evaluate(env))
            for env in ENVIRONMENTS
        ]
        keys[_key(requirement.name, str(requirement.specifier), applies)] += 1
    return keys


def _project() -> dict[str, Any]:
    [project] = [p for p in LOCK["package"] if p["name"] == PROJECT]
    return project


def locked_requirements() -> Counter[Key]:
    """The project's requirements as uv.lock recorded them."""
    keys: Counter[Key] = Counter()
    for item in _project()["metadata"]["requires-dist"]:
        marker = Marker(item["marker"]) if "marker" in item else None
        applies = [marker is None or marker.evaluate(env) for env in ENVIRONMENTS]
        keys[_key(item["name"], item.get("specifier", ""), applies)] += 1
    return keys


def locked_versions() -> dict[str, set[str]]:
    versions: dict[str, set[str]] = {}
    for package in LOCK["package"]:
        if package["name"] != PROJECT:
            versions.setdefault(canonicalize_name(package["name"]), set()).add(package["version"])
    return versions


def runtime_closure() -> set[str]:
    """Every package the image needs (the project and its `IMAGE_EXTRAS`), on any Python or
    platform."""
    packages = {canonicalize_name(p["name"]): p for p in LOCK["package"]}
    project = _project()
    direct = list(project.get("dependencies", []))
    for extra in IMAGE_EXTRAS:
        direct += project.get("optional-dependencies", {})[extra]
    wanted = [(d["name"], tuple(d.get("extra", ()))) for d in direct]
    seen: set[str] = set()
    while wanted:
        name, extras = wanted.pop()
        package = packages[canonicalize_name(name)]
        deps = list(package.get("dependencies", []))
        for extra in extras:
            deps += package.get("optional-dependencies", {}).get(extra, [])
        if canonicalize_name(name) in seen and not extras:
            continue
        seen.add(canonicalize_name(name))
        wanted += [(d["name"], tuple(d.get("extra", ()))) for d in deps]
    return seen


def pins(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of a `pip install --require-hashes` file."""
    found: dict[str, tuple[str, int]] = {}
    current = ""
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            current = canonicalize_name(match.group(1))
            assert current not in found, f"{path.name}: {current} pinned twice"
            found[current] = (match.group(2), 0)
        elif line.strip().startswith("--hash=sha256:") and current:
            version, hashes = found[current]
            found[current] = (version, hashes + 1)
    return found


def test_the_lock_was_made_from_this_pyproject() -> None:
    ours, locked = pyproject_requirements(), locked_requirements()
    assert ours == locked, (
        "pyproject.toml and uv.lock disagree; run `make lock`.\n"
        f"  only in pyproject.toml: {sorted(k[:2] for k in ours - locked)}\n"
        f"  only in uv.lock: {sorted(k[:2] for k in locked - ours)}"
    )
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(_project()["metadata"].get("provides-extras", [])) == extras
    assert LOCK["requires-python"].replace(" ", "") == PYPROJECT["project"]["requires-python"]


def test_the_image_requirements_are_the_locked_runtime_closure_with_hashes() -> None:
    runtime = pins(RUNTIME)
    assert set(runtime) == runtime_closure(), "requirements/runtime.txt is stale: `make lock`"
    versions = locked_versions()
    for name, (version, hashes) in runtime.items():
        assert version in versions[name], f"{name}=={version} is not the locked version"
        assert hashes, f"{name} has no --hash in requirements/runtime.txt"
    assert PROJECT not in runtime  # the image installs the project itself with --no-deps


def test_the_build_backend_is_pinned_with_hashes() -> None:
    build = pins(BUILD)
    for text in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in build, f"requirements/build.txt lacks {name}: `make lock`"
        assert Version(build[name][0]) in requirement.specifier, f"{name} pin breaks {text}"
    assert all(hashes for _, hashes in build.values()), "a build requirement has no --hash"


def test_the_markers_compare_what_they_mean() -> None:
    """uv writes `python_version < '3.13'` as `python_full_version < '3.13'`: the same."""
    short = Marker("python_version < '3.13'")
    full = Marker("python_full_version < '3.13'")
    assert [short.evaluate(env) for env in ENVIRONMENTS] == [
        full.evaluate(env) for env in ENVIRONMENTS
    ]
    assert _key("PGServer", ">=1, <2", [True]) == _key("pgserver", "<2,>=1", [True])
