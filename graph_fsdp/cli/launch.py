"""Where the ranks of a CLI command run: in-process under a launcher, or spawned locally.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process runs its own rank in-process.
Without a launcher the CLI spawns the local ranks itself through
:func:`graph_fsdp.testing.spawn`: one NCCL process per GPU, or ``--nproc`` gloo processes
on a CPU-only machine. Either way only rank 0's result comes back to the caller, which is
the one process that prints and writes reports.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.supervision import Interrupted, WorkerIO, supervise
from graph_fsdp.distributed import init_distributed
from graph_fsdp.interrupt import (
    install_stop_handlers,
    request_stop,
    stop_requested,
    stop_signal,
)
from graph_fsdp.testing import spawn

DEFAULT_CPU_NPROC = 2


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Resolved device, backend and world size of a command (no GPU work done yet)."""

    device: str
    """cpu or cuda."""
    backend: str
    """gloo (cpu) or nccl (cuda)."""
    world_size: int
    """Data-parallel ranks."""
    under_launcher: bool
    """True under torchrun: this process is one rank, the others already exist."""
    rank: int = 0
    """This process's rank under a launcher (0 when the CLI spawns the ranks)."""
    local_rank: int = 0
    """This process's GPU under a launcher."""

    def describe(self) -> str:
        how = "torchrun" if self.under_launcher else "spawned"
        return f"{self.world_size} x {self.device} ({self.backend}, {how})"


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


def _rank_entry(
    rank: int, world_size: int, device: str, io: WorkerIO, fn: Callable, *args: object
) -> object:
    install_stop_handlers()  # interrupt.py; until now SIGINT is ignored (supervision.py)
    early = io.signal_before_start()
    if early is not None:
        request_stop(early)
    io.redirect(rank)  # supervision.py [Note: quiet ranks]
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Local gloo ranks share the machine's cores; oversubscription makes steps erratic.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        result = fn(rank, world_size, *args)
    except BaseException as err:
        io.record_failure(rank, err)
        raise
    if rank == 0 and stop_requested():  # the launcher need not wait for the teardown
        io.keep_stopped_result(result, stop_signal())
    _finish_together(world_size)
    return result


def _finish_together(world_size: int) -> None:
    """Leave the process group in a state that can be destroyed before interpreter exit.

    [Note: gloo teardown] A gloo worker thread frees the last collectives' work objects,
    which hold Python thread-local state; if that happens while the interpreter finalises,
    the thread cannot take the GIL and the process aborts ("terminate called without an
    active exception"). So: every rank finishes its collectives (barrier), and reference
    cycles that keep the engine and its group alive are collected now, so that
    ``destroy_process_group`` really destroys the group (joining its threads, GIL released)
    while Python is still fully alive.
    """
    if world_size > 1 and dist.is_initialized():
        dist.barrier()
    gc.collect()


def launch(plan: LaunchPlan, fn: Callable, *args: object) -> object | None:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's result.

    Returns None in the processes of other ranks under a launcher (they report nothing).
    ``fn`` must be a module-level function (it is pickled by reference when spawning).
    Raises :class:`RankFailure` (one line; the tracebacks in a log it names) when a spawned
    rank failed, :class:`Interrupted` when SIGINT/SIGTERM stopped the run (supervision.py).
    """
    if not plan.under_launcher:

        def run(io: WorkerIO) -> list:
            return spawn(
                _rank_entry, plan.world_size, plan.device, io, fn, *args, backend=plan.backend
            )

        name = getattr(fn, "__name__", "").removesuffix("_worker").strip("_") or "run"
        return supervise(plan.world_size, name, run)
    install_stop_handlers()  # this process is one rank: interrupt.py
    initialised_here = not dist.is_initialized()
    if initialised_here:
        if plan.device == "cuda":
            from graph_fsdp.capture.te_backend import preload_te  # noqa: PLC0415

            preload_te()
        # Bounded collective timeout and NCCL watchdog settings (graph_fsdp/distributed.py).
        init_distributed(plan.backend)
    try:
        result = fn(plan.rank, plan.world_size, *args)
        _finish_together(plan.world_size)
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()  # see [Note: gloo teardown]
    if stop_requested():
        raise Interrupted(stop_signal(), result if plan.rank == 0 else None)
    return result if plan.rank == 0 else None
