"""A training run's checkpoints, Megatron's way: one directory per saved iteration and a
tracker naming the latest complete one::

    DIR/iter_0000020/                       a checkpoint (graph_fsdp.fsdp.checkpoint.save)
    DIR/iter_0000040/
    DIR/latest_checkpointed_iteration.txt   "40"

[Note: the latest complete checkpoint] Each save writes ``iter_NNNNNNN`` atomically
(checkpoint.py [Note: atomic checkpoint replacement]); only after it is complete on every
rank does rank 0 replace the tracker (written to a temporary file, synced, renamed), and only
then are checkpoints beyond the last ``keep_last`` removed. A kill at any moment leaves the
tracker naming a complete checkpoint: the new one, or the one before. Resuming from ``DIR``
(:func:`resolve_checkpoint`) reads the iteration the tracker names; a directory that is itself
one checkpoint (the older layout, or an ``iter_`` directory) loads as it is. A save never
writes a model holding NaN or Inf (:func:`~graph_fsdp.training.nonfinite.check_finite_model`).

[Note: optimizer settings on resume] ``Optimizer.load_state_dict`` restores the learning rate
and weight decay a checkpoint was written with, replacing the values the run asked for - so a
resumed run used to ignore a changed ``lr`` without a word. :func:`resume_optimizer_settings`
compares them after the load: ``"check"`` refuses a difference naming both values, ``"config"``
takes the run's values (Megatron's ``--override-opt_param-scheduler``), ``"checkpoint"`` keeps
the checkpoint's (``--use-checkpoint-opt_param-scheduler``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.checkpoint_files import is_no_space, no_space_message

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""In a run's checkpoint directory: the iteration of the latest complete checkpoint."""

ITERATION_DIR = re.compile(r"iter_(\d{7,})")
"""``iter_0000020``: Megatron's name of an iteration's checkpoint directory."""

OPTIMIZER_SETTINGS = ("lr", "weight_decay")
"""The optimizer hyperparameters a run sets and a checkpoint records, compared on resume."""

RESUME_MODES = ("check", "config", "checkpoint")


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """A run's checkpoints (``LoopConfig.checkpoint``): where and when it saves, what it resumes
    from. Nothing is saved without ``save_path``."""

    save_path: str | None = None
    """The run's checkpoint directory: one ``iter_NNNNNNN`` DCP checkpoint per save and
    ``latest_checkpointed_iteration.txt`` naming the latest complete one ([Note: the latest
    complete checkpoint])."""
    save_at: int = 0
    """Save after this many steps of this run (the CLI: its last step); 0: not."""
    save_interval: int = 0
    """Also save after every iteration that is a multiple of this (Megatron's
    ``--save-interval``); 0: not."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints in ``save_path`` (None: all)."""
    save_on_interrupt: bool = False
    """Save to ``save_path`` when a stop request (SIGINT/SIGTERM, interrupt.py) ends the run
    early, at the step boundary where it stops."""
    load_path: str | None = None
    """Checkpoint to resume from before training (steps continue at the config's
    ``start_step``): a run's checkpoint directory (the iteration its tracker names) or one
    checkpoint directory."""
    resume_optimizer_settings: str = "check"
    """On resume, when ``lr`` or ``weight_decay`` differ from the checkpoint's: "check"
    refuses, "config" takes the run's, "checkpoint" the checkpoint's ([Note: optimizer
    settings on resume])."""

    def __post_init__(self) -> None:
        if self.resume_optimizer_settings not in RESUME_MODES:
            raise ValueError(
                f"CheckpointPolicy.resume_optimizer_settings={self.resume_optimizer_settings!r} "
                f"must be one of {RESUME_MODES}"
            )
        for name in ("save_at", "save_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CheckpointPolicy.{name}={value!r} must be an int >= 0 (0: not)")
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool)
            or not isinstance(self.keep_last, int)
            or self.keep_last < 1
        ):
            raise ValueError(
                f"CheckpointPolicy.keep_last={self.keep_last!r} must be an int >= 1, or None "
                "to keep every checkpoint"
            )

    def saves_after(self, iteration: int, *, start_step: int, stopping: bool) -> bool:
        """A checkpoint after ``iteration`` of a run that started at ``start_step``: the
        run's ``save_at``, a multiple of ``save_interval``, or a stop with
        ``save_on_interrupt`` (never without ``save_path``)."""
        return bool(self.save_path) and (
            iteration == start_step + self.save_at
            or bool(self.save_interval and iteration % self.save_interval == 0)
            or (stopping and self.save_on_interrupt)
        )


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration ``root``'s tracker names; None when ``root`` has no tracker."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
        iteration = int(text)
    except (OSError, ValueError) as err:
        raise ckpt.CheckpointError(
            f"{path} is unreadable or not an iteration number ({err}); write the iteration of "
            "the checkpoint to resume from into it (an iter_NNNNNNN directory beside it), or "
            "load that directory itself"
        ) from None
    if iteration < 0:
        raise ckpt.CheckpointError(f"{path} names iteration {iteration}, which is < 0")
    return iteration


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory a load of ``path`` reads: for a run's directory (a tracker in
    it), the iteration the tracker names; else ``path`` itself (one checkpoint)."""
    iteration = read_tracker(path)
    if iteration is None:
        return path
    target = iteration_dir(path, iteration)
    if not any(os.path.isfile(os.path.join(t, ".metadata")) for t in (target, f"{target}.old")):
        raise ckpt.CheckpointError(
            f"{os.path.join(path, TRACKER_FILE)} names iteration {iteration}, but {target} is "
            "not a complete checkpoint (its .metadata is missing); load another iter_NNNNNNN "
            "directory of it, or write the iteration of one into the tracker"
        )
    return target


def saved_iterations(root: str) -> list[int]:
    """The iterations with a checkpoint directory in ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    found = (ITERATION_DIR.fullmatch(n) for n in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m)


def run_dir_problem(root: str) -> str | None:
    """Why a save into ``root`` would replace or mix with something that is not this layout's
    (None: absent, empty, or a run's checkpoint directory): for an error after ``root``."""
    if not os.path.lexists(root):
        return None
    if not os.path.isdir(root) or os.path.islink(root):
        return "is a file, not a checkpoint directory; pass a directory path"
    names = sorted(os.listdir(root))
    if ckpt.META_FILE in names or ".metadata" in names:
        return (
            "is a single checkpoint (the layout before iter_NNNNNNN directories): loading it "
            "works, but a run saves iter_NNNNNNN directories and a tracker; save to a new or "
            "empty directory"
        )
    for name in names:
        if name in (TRACKER_FILE, f"{TRACKER_FILE}.tmp"):
            continue
        path = os.path.join(root, name)
        stem = name.removesuffix(".tmp").removesuffix(".old")
        if not ITERATION_DIR.fullmatch(stem):
            what = f"holds {name!r}"
        elif ckpt.is_checkpoint_dir(path):
            continue
        elif os.path.isdir(path) and not os.path.islink(path):
            inside = sorted(os.listdir(path))
            what = (
                f"holds {name!r} with files that are not a checkpoint's ({', '.join(inside[:3])})"
            )
        else:
            what = f"holds {name!r}, a file"
        return (
            f"{what}, not a graph_fsdp run's (iter_NNNNNNN checkpoints and {TRACKER_FILE}); a "
            "save never deletes or replaces other files: save to a new or empty directory"
        )
    return None


def write_tracker(root: str, iteration: int) -> None:
    """Rank 0: the tracker names ``iteration``, replaced atomically (synced, then renamed)."""
    path = os.path.join(root, TRACKER_FILE)
    part = f"{path}.tmp"
    try:
        with open(part, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as err:
        why = no_space_message(part) if is_no_space(err) else f"{err.strerror}: {part}"
        raise ckpt.CheckpointError(
            f"updating {path} failed: {why}; it still names the previous checkpoint"
        ) from err


def prune(root: str, *, keep_last: int, latest: int) -> list[int]:
    """Rank 0: remove the checkpoints of ``root`` older than the ``keep_last`` newest up to
    ``latest`` (the tracker's); iterations after ``latest`` (an earlier, longer run's) stay.
    Returns the iterations removed."""
    older = [i for i in saved_iterations(root) if i <= latest]
    removed = []
    for iteration in older[: max(0, len(older) - keep_last)]:
        path = iteration_dir(root, iteration)
        if ckpt.is_checkpoint_dir(path, require_meta=True):  # never anything else
            shutil.rmtree(path)
            removed.append(iteration)
    return removed


def save_iteration(
    save: Callable[[str], None], root: str, iteration: int, *, keep_last: int | None
) -> str:
    """Every rank: ``save(iteration_dir)`` (an atomic checkpoint save), then the tracker and
    the pruning ([Note: the latest complete checkpoint]); returns the directory written."""
    problem = run_dir_problem(root)
    if problem is not None:
        raise ckpt.CheckpointError(f"checkpoint directory {root!r} {problem}")
    target = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    try:
        save(target)
    except ckpt.CheckpointError as err:
        latest = read_tracker(root)
        kept = f"; {root} still holds iteration {latest}" if latest is not None else ""
        raise ckpt.CheckpointError(f"{err}{kept}") from err
    if dist.get_rank() == 0:
        write_tracker(root, iteration)
        if keep_last is not None:
            prune(root, keep_last=keep_last, latest=iteration)
    dist.barrier()
    return target


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """:data:`OPTIMIZER_SETTINGS` of the optimizer's first parameter group, as numbers."""
    group = optimizer.param_groups[0]
    return {k: float(group[k]) for k in OPTIMIZER_SETTINGS if k in group}


def resume_optimizer_settings(
    optimizer: torch.optim.Optimizer, wanted: dict[str, float], *, mode: str, path: str
) -> None:
    """After a checkpoint load: the run's ``wanted`` settings against the checkpoint's
    ([Note: optimizer settings on resume]); ``mode`` is one of :data:`RESUME_MODES`."""
    if mode not in RESUME_MODES:
        raise ValueError(f"resume_optimizer_settings={mode!r}: one of {RESUME_MODES}")
    if mode == "checkpoint":
        return
    differ = {
        k: (v, float(g[k]))
        for g in optimizer.param_groups
        for k, v in wanted.items()
        # A learning rate kept on the device is a float32 tensor: equal to its float32 bits.
        if k in g and not math.isclose(float(g[k]), float(v), rel_tol=1e-6)
    }
    if mode == "config":
        for g in optimizer.param_groups:
            g.update({k: v for k, v in wanted.items() if k in g})
        return
    if differ:
        listed = "; ".join(
            f"{k} {run:g} (this run) vs {saved:g} (the checkpoint)"
            for k, (run, saved) in differ.items()
        )
        raise ValueError(
            f"resuming from {path!r}: the optimizer settings differ from the checkpoint's: "
            f"{listed}; set resume_optimizer_settings='config' to train with this run's values "
            "or 'checkpoint' to keep the checkpoint's"
        )
