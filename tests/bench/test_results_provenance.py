"""Every result a document cites can be traced to a tree in the repository.

A file of ``bench/results`` that README.md or a page of docs/ links to or names must exist
and name the commit it ran (``commit <sha>``, ``"commit": "<sha>"``, ``tree <sha>`` or
``"code": "<sha>"``, as
the bench, the GPU test script and the logs write it; a ``.png`` by the ``.md`` or ``.json``
of the same name), and that commit must be reachable from HEAD. Results that cannot meet
this (run before results were stamped, or on a tree that was never committed) are cited only
under a heading that says "not reproducible from a commit". Names are read from backticks
and link targets: brace lists (``{md,json}``) and globs (``*``) expand over the folder;
abbreviations (``..._graphs.log``) are refused: a reader cannot resolve them.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = "not reproducible from a commit"
"""A heading with these words exempts what its section cites (it says why)."""

_DATE = re.compile(r"20\d\d-\d\d-\d\d")
_TOKEN = re.compile(r"`([^`\s]+)`|\]\(([^)\s]+)\)")
_STAMP = re.compile(r"\b(?:commit|tree|code)\b[\"']?\s*[:=]?\s*[\"']?([0-9a-f]{7,40})\b")


def _expand_braces(name: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _result_name(token: str) -> str | None:
    """The name under bench/results a backticked token or link target refers to, if any."""
    if "<" in token:  # a pattern of names (``<date>``), not a file
        return None
    if "bench/results/" in token:
        return token.split("bench/results/", 1)[1] or None  # the folder itself: no file
    is_file = re.search(r"\.(md|json|log|png|\{[a-z,]+\})$", token) is not None
    if is_file and (_DATE.search(token) or token.startswith("...")):
        return token
    return None


def cited_results() -> list[tuple[str, int, str]]:
    """``(document, line, name)`` of every result named outside a history section."""
    out = []
    for doc in DOCUMENTS:
        headings: dict[int, str] = {}
        fenced = False
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            heading = None if fenced else re.match(r"(#+)\s+(.*)", line)
            if heading:
                level = len(heading.group(1))
                headings = {k: v for k, v in headings.items() if k < level}
                headings[level] = heading.group(2)
                continue
            if any(HISTORY in h for h in headings.values()):
                continue
            for match in _TOKEN.finditer(line):
                name = _result_name(match.group(1) or match.group(2))
                if name is not None:
                    out.append((doc.relative_to(ROOT).as_posix(), number, name))
    return out


def _files(name: str) -> list[Path]:
    return sorted(p for n in _expand_braces(name) for p in RESULTS.glob(n))


def _stamp(path: Path) -> str | None:
    """The first commit the file names (a picture: its table's)."""
    if path.suffix == ".png":
        for sibling in (path.with_suffix(".md"), path.with_suffix(".json")):
            if sibling.exists():
                return _stamp(sibling)
        return None
    match = _STAMP.search(path.read_text(errors="replace"))
    return match.group(1) if match else None


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _history_available() -> str | None:
    """Why reachability cannot be checked here (None: it can)."""
    if shutil.which("git") is None:
        return "git is not installed"
    inside = _git("rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return "not a git checkout"
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        return "a shallow clone: older commits are missing (fetch with --unshallow)"
    return None


def test_the_scan_finds_citations_and_refuses_abbreviations():
    cited = cited_results()
    assert len(cited) >= 20, cited  # the documents cite results: the scan reads them
    names = {name for _, _, name in cited}
    assert "whole_step_full_table_h200x2_2026-11-27_noreg.json" in names
    assert _expand_braces("a_{1,2}.{md,json}") == ["a_1.md", "a_1.json", "a_2.md", "a_2.json"]
    assert _result_name("docs/cli.md") is None and _result_name("..._world1.log") is not None
    short = [f"{doc}:{line}: {name}" for doc, line, name in cited if name.startswith("...")]
    assert not short, f"abbreviated result names (write them in full): {short}"


def test_cited_results_exist_and_name_a_commit():
    problems = []
    for doc, line, name in cited_results():
        files = [] if name.startswith("...") else _files(name)
        if not files:
            problems.append(f"{doc}:{line}: {name}: no such file in bench/results")
        problems += [
            f"{doc}:{line}: {f.name}: names no commit ('commit <sha>', 'tree <sha>')"
            for f in files
            if _stamp(f) is None
        ]
    assert not problems, "\n".join(problems)


def test_cited_results_ran_a_commit_of_this_history():
    reason = _history_available()
    if reason is not None:
        pytest.skip(f"cannot check reachability: {reason}")
    problems = []
    for doc, line, name in cited_results():
        for f in [] if name.startswith("...") else _files(name):
            sha = _stamp(f)
            if sha is None:
                continue  # the test above reports it
            known = _git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
            if not known or _git("merge-base", "--is-ancestor", sha, "HEAD").returncode != 0:
                problems.append(
                    f"{doc}:{line}: {f.name} ran {sha}, which HEAD does not contain: cite it "
                    f"under a heading that says '{HISTORY}', or re-run it"
                )
    assert not problems, "\n".join(problems)
