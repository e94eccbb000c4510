"""Commit stamps of results and GPU logs (graph_fsdp/bench/provenance.py [Note: provenance]):
git when there is a checkout, ``$GRAPH_FSDP_COMMIT`` on a copy without ``.git``, else
"unknown"; a digest of the package source either way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graph_fsdp.bench import provenance as pv

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git binary")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout holding a tiny ``graph_fsdp`` package, one commit."""
    repo = tmp_path / "repo"
    (repo / "graph_fsdp").mkdir(parents=True)
    (repo / "graph_fsdp" / "__init__.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_git_commit_and_dirty_state(checkout: Path) -> None:
    pkg = checkout / "graph_fsdp"
    v = pv.describe_code(pkg, None)
    head = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert v == {
        "commit": head,
        "dirty": False,
        "commit_source": "git",
        "source_sha256": pv.source_digest(pkg),
    }
    assert (
        pv.stamp_line(v)
        == f"commit {head} (clean; from git), graph_fsdp source sha256 " + (v["source_sha256"])
    )
    # A commit the caller names wins over the checkout's: a copied tree may carry a .git of
    # an older commit than its files.
    named = pv.describe_code(pkg, "f00d")
    assert (named["commit"], named["dirty"], named["commit_source"]) == (
        "f00d",
        False,
        f"${pv.COMMIT_ENV}",
    )
    # Results written beside the code do not make the tree dirty ...
    (checkout / "bench" / "results").mkdir(parents=True)
    (checkout / "bench" / "results" / "r.json").write_text("{}")
    assert pv.describe_code(pkg, None)["dirty"] is False
    # ... a new module, or a changed tracked file, does.
    (pkg / "new.py").write_text("y = 2\n")
    changed = pv.describe_code(pkg, None)
    assert changed["dirty"] is True and changed["source_sha256"] != v["source_sha256"]
    assert "(DIRTY; from git)" in pv.stamp_line(changed)
    (pkg / "new.py").unlink()
    (pkg / "__init__.py").write_text("x = 2\n")
    assert pv.describe_code(pkg, None)["dirty"] is True


def test_without_git_the_environment_names_the_commit(tmp_path: Path, checkout: Path) -> None:
    copy = tmp_path / "copy" / "graph_fsdp"  # the tree as a GPU host receives it: no .git
    shutil.copytree(checkout / "graph_fsdp", copy)
    assert pv.from_git(copy.parent) is None
    v = pv.describe_code(copy, "abc123-dirty")
    assert (v["commit"], v["dirty"], v["commit_source"]) == ("abc123", True, "$GRAPH_FSDP_COMMIT")
    assert pv.describe_code(copy, "abc123")["dirty"] is False
    unknown = pv.describe_code(copy, "  ")
    assert (unknown["commit"], unknown["dirty"], unknown["commit_source"]) == (
        "unknown",
        None,
        "unknown",
    )
    assert "commit unknown (not a git checkout and $GRAPH_FSDP_COMMIT unset)" in pv.stamp_line(
        unknown
    )
    # The digest is the package's, wherever it lives.
    assert v["source_sha256"] == pv.source_digest(checkout / "graph_fsdp")


def test_a_package_inside_another_projects_checkout_is_not_that_commit(checkout: Path) -> None:
    nested = checkout / "vendor" / "graph_fsdp"
    nested.mkdir(parents=True)
    (nested / "__init__.py").write_text("")
    assert pv.from_git(nested.parent) is None  # its parent is not the checkout's top level


def test_the_command_line_stamp_of_a_copy_without_git(tmp_path: Path) -> None:
    """What tools/gpu_tests.sh prints in its log headers, run on a copy of this package."""
    root = tmp_path / "host"
    shutil.copytree(
        pv.PACKAGE_DIR, root / "graph_fsdp", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**os.environ, "PYTHONPATH": str(root), pv.COMMIT_ENV: "f00d-dirty"}
    out = subprocess.run(
        [sys.executable, "-m", "graph_fsdp.bench.provenance", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=True,
    ).stdout
    v = json.loads(out)
    assert (v["commit"], v["dirty"], v["commit_source"]) == ("f00d", True, "$GRAPH_FSDP_COMMIT")
    assert v["source_sha256"] == pv.source_digest()
