"""The files and directories a command will write, checked before any rank starts.

A run that can only fail at its end (a checkpoint directory that cannot be created, a step
log that is a directory) is refused at once, with the path and the fix; nothing is created
or changed by the checks (a probe file is created and removed in the directory that would
hold the output).
"""

from __future__ import annotations

import os
import tempfile

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.training import checkpoints as run_checkpoints


def _existing_ancestor(path: str) -> str:
    """The nearest ancestor of ``path`` (itself excluded) that exists."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent


def check_can_create(flag: str, path: str) -> None:
    """``path`` (absent, or replaced by renames in its directory) can be created: the nearest
    existing ancestor is a directory this process can write into."""
    ancestor = _existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise CLIError(
            f"{flag} {path}: {ancestor} is a file, so nothing can be created under it; "
            "pass a path in a directory"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".graph_fsdp_probe_")
    except OSError as err:
        raise CLIError(
            f"{flag} {path}: cannot write in {ancestor} ({err.strerror}: read-only file system "
            "or no permission); pass a path in a writable directory"
        ) from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(flag: str, path: str) -> None:
    """A file the run (over)writes, e.g. ``--log-json``."""
    if os.path.isdir(path):
        example = os.path.join(path, "steps.jsonl")
        raise CLIError(f"{flag} {path} is a directory; pass a file path (e.g. {example})")
    if os.path.exists(path):
        try:
            with open(path, "a"):
                pass
        except OSError as err:
            raise CLIError(f"{flag} {path}: cannot write it ({err.strerror})") from None
        return
    check_can_create(flag, path)


def check_output_dir(flag: str, path: str) -> None:
    """A directory the run writes files into, e.g. ``--output-dir``."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a file, not a directory; pass a directory path")
    if os.path.isdir(path):
        check_can_create(flag, os.path.join(path, "probe"))
    else:
        check_can_create(flag, path)


def check_save_dir(flag: str, path: str) -> None:
    """The run's checkpoint directory ``--save`` writes: ``iter_NNNNNNN`` checkpoints (each
    replaced atomically) and ``latest_checkpointed_iteration.txt``
    (graph_fsdp/training/checkpoints.py). It must be absent, empty, or such a directory: a save
    replaces checkpoints in it, so anything else - other files, a regular file, a single
    checkpoint of the older layout - is refused, naming it.
    """
    problem = run_checkpoints.run_dir_problem(path)
    if problem is not None:
        raise CLIError(f"{flag} {path} {problem}")
    check_can_create(flag, path)
