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
from graph_fsdp.fsdp import checkpoint


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
    """A checkpoint directory ``--save`` writes (and replaces atomically: renames next to it).

    It must be absent, empty, or a checkpoint graph-fsdp wrote (recognised by
    :data:`graph_fsdp.fsdp.checkpoint.META_FILE`): a save replaces its target, so anything else -
    a directory of other files, a regular file - is refused, naming it.
    """
    if os.path.isdir(path) and not checkpoint.is_checkpoint_dir(path, require_meta=True):
        names = sorted(os.listdir(path))
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        raise CLIError(
            f"{flag} {path} is a directory holding other files ({shown}) and no "
            f"{checkpoint.META_FILE}, so not a checkpoint graph-fsdp wrote; a save replaces its "
            "target: pass a new or empty directory"
        )
    try:
        checkpoint.check_save_target(path, require_meta=True)
    except checkpoint.CheckpointError as err:
        raise CLIError(f"{flag} {err}") from None
    check_can_create(flag, path)
