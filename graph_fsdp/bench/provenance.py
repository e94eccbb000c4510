"""Which code produced a result: the git commit, whether the tree was dirty, a source digest.

[Note: provenance] Every results file the ``bench``, ``profile`` and ``compare`` commands
write, and every GPU log header of ``tools/gpu_tests.sh`` and ``tools/gpu_perf_run.sh``,
carries :func:`code_version`:

- ``commit`` and ``dirty`` from ``$GRAPH_FSDP_COMMIT`` when it is set: the caller names the
  commit of a copied tree (a GPU host receives the working tree, and a ``.git`` that came
  with it may describe an older commit than the files): set it where git is, e.g.
  ``GRAPH_FSDP_COMMIT=$(git describe --always --dirty --abbrev=40)`` (a ``-dirty`` suffix
  marks a dirty tree);
- else from git when the package sits in a git checkout (``dirty``: a tracked file differs
  from the commit, or an untracked one sits among the code - results written under
  ``bench/`` do not count);
- else ``"unknown"``.

``source_sha256`` is a digest of every ``.py`` file of the ``graph_fsdp`` package (paths and
contents), computed wherever the code runs: the same digest here and on the GPU host means
the same package code, whatever git says. ``python -m graph_fsdp.bench.provenance`` prints
the one-line stamp (``--json``: the dict).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path

COMMIT_ENV = "GRAPH_FSDP_COMMIT"
"""The commit of a tree without ``.git`` (``<sha>`` or ``<sha>-dirty``)."""

DIRTY_SUFFIX = "-dirty"

PACKAGE_DIR = Path(__file__).resolve().parent.parent
"""The ``graph_fsdp`` package directory."""


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """sha256 (first 16 hex digits) over the sorted relative paths and contents of every
    ``.py`` file under ``package_dir``."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def from_git(root: Path) -> dict | None:
    """``{"commit", "dirty"}`` of the checkout whose top level is ``root``, else None (no git,
    not a checkout, or ``root`` sits inside another project's checkout)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=all")
    if not commit or status is None:
        return None
    return {"commit": commit, "dirty": any(_counts(line) for line in status.splitlines())}


CODE_DIRS = ("graph_fsdp/", "tests/", "tools/")
"""Where an untracked (not ignored) file makes the tree dirty: code. Elsewhere (results
written under ``bench/``) it does not."""


def _counts(status_line: str) -> bool:
    """A ``git status --porcelain`` line that makes the tree dirty."""
    if not status_line.startswith("??"):
        return bool(status_line.strip())
    return status_line[3:].strip('"').startswith(CODE_DIRS)


def from_env(value: str | None) -> dict | None:
    """``{"commit", "dirty"}`` from a ``$GRAPH_FSDP_COMMIT`` value, else None."""
    value = (value or "").strip()
    if not value:
        return None
    dirty = value.endswith(DIRTY_SUFFIX)
    return {"commit": value[: -len(DIRTY_SUFFIX)] if dirty else value, "dirty": dirty}


def describe_code(package_dir: Path, env_value: str | None) -> dict:
    """``{"commit", "dirty", "commit_source", "source_sha256"}`` of the package in
    ``package_dir`` (``env_value`` when set, else git of its parent directory, else unknown;
    ``dirty`` is None where the commit is unknown)."""
    found, where = from_env(env_value), f"${COMMIT_ENV}"
    if found is None:
        found, where = from_git(package_dir.parent), "git"
    if found is None:
        found, where = {"commit": "unknown", "dirty": None}, "unknown"
    return {**found, "commit_source": where, "source_sha256": source_digest(package_dir)}


@functools.cache
def code_version() -> dict:
    """:func:`describe_code` of the running graph_fsdp (once per process): see [Note:
    provenance]."""
    return describe_code(PACKAGE_DIR, os.environ.get(COMMIT_ENV))


def stamp_line(version: dict | None = None) -> str:
    """``commit <sha> (clean|DIRTY|dirty unknown; from git|$GRAPH_FSDP_COMMIT), graph_fsdp
    source sha256 <digest>``: the line a report or a log header carries."""
    v = version or code_version()
    if v["commit"] == "unknown":
        commit = f"commit unknown (not a git checkout and ${COMMIT_ENV} unset)"
    else:
        state = {True: "DIRTY", False: "clean", None: "dirty unknown"}[v["dirty"]]
        commit = f"commit {v['commit']} ({state}; from {v['commit_source']})"
    return f"{commit}, graph_fsdp source sha256 {v['source_sha256']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--json", action="store_true", help="print the dict as JSON")
    args = p.parse_args(argv)
    print(json.dumps(code_version()) if args.json else stamp_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
