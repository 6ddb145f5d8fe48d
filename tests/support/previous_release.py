"""The previous release of charge-worker, from git, in a venv of its own.

"The previous release" is the tree before the newest migration was added: the parent of the
commit that added the highest-numbered file in `migrations/` (HEAD itself while that file is
not committed yet), so a test pits the schema change under review against the code that
predates it. `CHARGE_WORKER_PREVIOUS_REV` names another revision instead (a release tag,
`CHARGE_WORKER_PREVIOUS_REV=v1.4.0`, or any commit).

The tree is `git archive REV src migrations`, unpacked: what a wheel of that release holds.
Its venv is made by the running interpreter. When the release pinned the runtime
dependencies the current tree pins (`requirements/runtime.txt`, exported from `uv.lock`), it
is made `--without-pip` with one `.pth` file: the old `src/` first, then the current venv's
site-packages, so the old code runs on the packages installed now, in a fraction of a
second. (`--system-site-packages` would not do: from a venv's interpreter it exposes the base
interpreter's packages, not the venv's.) The current tree is not importable there at all:
the editable install's own `.pth` sits in that directory, and the `.pth` files of a
directory a `.pth` line names are not read, so a module the old release lacks cannot be
filled in from the new one; `materialise` checks which `charge_worker` it imports. When the
pins differ, the venv gets pip and the release's own pins (`pip install --require-hashes`
from the index, as its image did), and only its `src/` on the `.pth`: slower, and only in
the release after a dependency change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from charge_worker.migrate import discover
from charge_worker.settings import Settings
from tests.support.harness import WorkerProcess, settings_env

REPO = Path(__file__).parents[2]
OVERRIDE = "CHARGE_WORKER_PREVIOUS_REV"
# what a release's code needs at run time: its package and its migrations (the wheel's
# force-include)
ARCHIVED = ("src", "migrations")
# the image's dependencies, exported from uv.lock
PINS = "requirements/runtime.txt"


class NoHistory(Exception):
    """This checkout has no git history (a tarball): there is no previous release to run."""


def git(*args: str, repo: Path = REPO) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def previous_revision(repo: Path = REPO) -> str:
    """The commit of the previous release (see the module docstring), as a full hash."""
    if not (repo / ".git").exists():
        raise NoHistory(f"{repo} is not a git checkout")
    if named := os.environ.get(OVERRIDE):
        return git("rev-parse", "--verify", f"{named}^{{commit}}", repo=repo)
    newest = discover(repo / "migrations")[-1].path.relative_to(repo)
    added = git("log", "--diff-filter=A", "--format=%H", "-1", "--", str(newest), repo=repo)
    if not added:  # the newest migration is not committed yet: HEAD predates it
        return git("rev-parse", "--verify", "HEAD^{commit}", repo=repo)
    try:
        return git("rev-parse", "--verify", f"{added}^{{commit}}^", repo=repo)
    except RuntimeError as error:
        raise RuntimeError(
            f"{newest} was added by {added[:12]}, whose parent this clone lacks (a shallow "
            f"clone?): fetch the history, or name a revision in {OVERRIDE}"
        ) from error


@dataclass(frozen=True)
class PreviousRelease:
    """The previous release unpacked in `tree`, run by `python` (its venv's interpreter)."""

    rev: str
    tree: Path
    python: Path
    # its own pins installed in its venv (they differ from the current tree's), rather than
    # the current venv's packages
    own_dependencies: bool

    @property
    def migrations(self) -> list[str]:
        """The versions of its migrations: its schema."""
        return [m.version for m in discover(self.tree / "migrations")]

    def cli(self, *args: str, settings: Settings) -> subprocess.CompletedProcess[str]:
        """`charge-worker ARGS` of this release, with these settings, to its end."""
        return subprocess.run(
            [str(self.python), "-m", "charge_worker", *args],
            env=_environment(settings),
            cwd=self.tree,
            capture_output=True,
            text=True,
            check=False,
        )


def materialise(rev: str, into: Path, repo: Path = REPO) -> PreviousRelease:
    """Unpack `rev` into `into`/tree and make its venv in `into`/venv: on the dependencies
    installed now when it pinned the same ones, else on its own pins, installed."""
    tree, venv = into / "tree", into / "venv"
    tree.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(repo), "archive", "--format=tar", rev, *ARCHIVED],
        stdout=subprocess.PIPE,
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    assert archive.stdout is not None
    archive.stdout.close()
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {rev} failed")
    try:
        pinned = git("show", f"{rev}:{PINS}", repo=repo)
    except RuntimeError as error:
        raise RuntimeError(f"{rev[:12]} has no {PINS}: name a later revision") from error
    same = pinned == (repo / PINS).read_text().strip()
    python = venv / "bin" / "python"
    make = [sys.executable, "-m", "venv", str(venv)]
    subprocess.run(make if not same else [*make, "--without-pip"], check=True)
    if not same:  # slow (a download and an install), only after a dependency change
        (into / "runtime.txt").write_text(pinned + "\n")
        install = ["-m", "pip", "install", "--quiet", "--require-hashes", "--no-deps"]
        subprocess.run([str(python), *install, "-r", str(into / "runtime.txt")], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=_isolated(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    lines = [str(tree / "src"), *(ours if same else ())]
    (Path(site) / "previous_release.pth").write_text("\n".join(lines) + "\n")
    imported = subprocess.run(
        [str(python), "-c", "import charge_worker; print(charge_worker.__file__)"],
        env=_isolated(),
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(imported).is_relative_to(tree):
        raise RuntimeError(f"the previous release's venv imports {imported}, not its own tree")
    return PreviousRelease(rev, tree, python, own_dependencies=not same)


class PreviousWorkerProcess(WorkerProcess):
    """`charge-worker run` of the previous release, as `WorkerProcess` runs the current one."""

    def __init__(self, release: PreviousRelease, settings: Settings, log: Path, **env: str):
        self.log = log
        self.killed = False
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(release.python), "-m", "charge_worker", "run"],
                env=_environment(settings) | env,
                cwd=release.tree,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )


def _isolated() -> dict[str, str]:
    """This process's environment but what would reach the old release from it: its
    charge-worker settings, and PYTHONPATH (the venv's .pth decides what is imported)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHARGE_WORKER_") and k != "PYTHONPATH"
    }


def _environment(settings: Settings) -> dict[str, str]:
    """`settings` for the old release (it ignores a variable it does not know, as its pods
    would), in an isolated environment."""
    return _isolated() | settings_env(settings) | {"CHARGE_WORKER_LOG_FORMAT": "json"}
