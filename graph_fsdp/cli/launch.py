"""Where the ranks of a CLI command run: the :class:`~graph_fsdp.training.processes.LaunchPlan` of
``--device``, ``--nproc`` and the launcher's environment.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process runs its own rank in-process;
without a launcher :func:`graph_fsdp.training.processes.launch` spawns the local ranks: one NCCL process
per GPU, or ``--nproc`` gloo processes on a CPU-only machine.
"""

from __future__ import annotations

import os

import torch

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.training.processes import LaunchPlan

DEFAULT_CPU_NPROC = 2


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as err:
        raise CLIError(f"environment variable {name}={value!r} is not an integer") from err


def resolve_plan(device: str, nproc: int | None) -> LaunchPlan:
    """Pick device/backend/world size from ``--device``, ``--nproc`` and the environment.

    Only asks whether CUDA exists and how many devices there are; creates no CUDA context.
    """
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise CLIError(
            "--device cuda was requested but torch.cuda.is_available() is False on this "
            f"machine (torch {torch.__version__}); use --device cpu (or auto)"
        )
    resolved = "cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu"
    backend = "nccl" if resolved == "cuda" else "gloo"
    if nproc is not None and nproc < 1:
        raise CLIError(f"--nproc {nproc} must be >= 1")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        local_rank = _env_int("LOCAL_RANK") or 0
        if resolved == "cuda" and local_rank >= torch.cuda.device_count():
            raise CLIError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                "check torchrun --nproc-per-node"
            )
        return LaunchPlan(
            device=resolved,
            backend=backend,
            world_size=world,
            under_launcher=True,
            rank=rank,
            local_rank=local_rank,
        )
    if resolved == "cuda":
        count = torch.cuda.device_count()
        if nproc is not None and nproc > count:
            raise CLIError(
                f"--nproc {nproc} exceeds the {count} visible GPUs; use --nproc <= {count}"
            )
        world = nproc or count
    else:
        world = nproc or DEFAULT_CPU_NPROC
    return LaunchPlan(device=resolved, backend=backend, world_size=world, under_launcher=False)
