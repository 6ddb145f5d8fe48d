"""Every repository file a doc, a docstring or a comment cites ships in the repository.

Scanned: README.md, docs/**/*.md, helm/charge-worker/README.md, and the docstrings and
comments of src/, tests/ and benchmarks/ (**/*.py). A citation is a path from the
repository's root (`docs/runbook.md`, `tests/unit/test_links.py`, `src/charge_worker/dlq.py`;
the old `contracts/<name>.md` was one that failed), a path out of it (`../shared/...`: a
user who clones the repository has no such file), or a relative Markdown link (`[the
runbook](runbook.md)`, from the file's own folder). Paths with a placeholder or a wildcard
(`<id>`, `{kind}`, `*`, `NNNN`) name no one file, and a path git ignores is an output a
command writes (`benchmarks/results/latest.json`): neither is checked.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ROOTS = "benchmarks|config|contracts|deploy|docs|helm|migrations|requirements|src|tests"
# A path from the root, not the tail of a longer path (`docs/contracts/<name>.md` does not
# cite `contracts/<name>.md`), ending in a file name with an extension.
CITED = re.compile(rf"(?<![\w./-])((?:\.\./)*(?:{ROOTS}|shared)/[\w./-]*\w\.[a-z]{{1,5}})\b")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
NOT_ONE_FILE = re.compile(r"[<>{}*]|\b([A-Z])\1{2,}")


def sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "helm" / "charge-worker" / "README.md"]
    found += sorted((ROOT / "docs").rglob("*.md"))
    for folder in ("src", "tests", "benchmarks"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return [path for path in found if path.is_file()]


def prose_of_python(text: str) -> Iterator[tuple[int, str]]:
    """Comments and docstrings, with their line numbers; code and other strings left out."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ) and (docstring := ast.get_docstring(node, clean=False)):
            for offset, line in enumerate(docstring.splitlines()):
                yield node.body[0].lineno + offset, line


def prose_of(path: Path) -> Iterator[tuple[int, str]]:
    text = path.read_text()
    if path.suffix == ".py":
        yield from prose_of_python(text)
    else:
        yield from enumerate(text.splitlines(), start=1)


def citations(path: Path) -> Iterator[tuple[int, str, Path]]:
    """(line, as written, the file it names) for every citation in `path`."""
    for line, text in prose_of(path):
        for match in CITED.finditer(text):
            cited = match.group(1).rstrip(".")
            if not NOT_ONE_FILE.search(cited):
                base = path.parent if cited.startswith("../") else ROOT
                yield line, cited, base / cited
        if path.suffix == ".md":
            for match in MD_LINK.finditer(text):
                target = match.group(1)
                if "://" not in target and not target.startswith("mailto:"):
                    yield line, target, path.parent / target


def ignored_by_git(paths: list[Path]) -> set[Path]:
    """The paths git ignores: what a command writes, never committed."""
    inside = [path for path in paths if path.is_relative_to(ROOT)]
    if not inside:
        return set()
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(str(path.relative_to(ROOT)) for path in inside),
        capture_output=True,
        text=True,
        check=False,
    )
    return {ROOT / line for line in result.stdout.splitlines()}


def missing(path: Path) -> list[str]:
    absent = [
        (line, cited, target.resolve())
        for line, cited, target in citations(path)
        if not target.resolve().is_relative_to(ROOT) or not target.exists()
    ]
    outputs = ignored_by_git([target for _, _, target in absent])
    return [
        f"{path.relative_to(ROOT)}:{line}: {cited}"
        for line, cited, target in absent
        if target not in outputs
    ]


SOURCES = sources()


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_cited_files_exist(path: Path) -> None:
    assert missing(path) == []


def test_the_scan_finds_what_it_must() -> None:
    assert len(SOURCES) > 50
    text = '"""See contracts/gateway.md."""\n# docs/contracts/x.md\nx = 1\n'
    found = [cited for _, prose in prose_of_python(text) for cited in CITED.findall(prose)]
    assert sorted(found) == ["contracts/gateway.md", "docs/contracts/x.md"]
    assert CITED.findall("`../shared/contracts/gateway.md`") == ["../shared/contracts/gateway.md"]
    assert not CITED.findall("`src/charge_worker/` and tests/unit/")  # folders: no file
    code = 'error = "contracts/gateway.md has no such route"\n'
    assert list(prose_of_python(code)) == []  # a string in code is no citation
